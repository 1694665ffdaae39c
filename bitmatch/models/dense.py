"""The dense decoder family (Qwen2, Qwen3, Llama, Mistral) written once on bitmatch.kernels.

Every path that computes a token's logits runs these functions in this order: the trainer
(``bitmatch.token_logprobs``), the patched HF forward (``bitmatch.patch``), the embedded engine
(``bitmatch.Engine``) and the vLLM plugin. The HF modules are only parameter holders here: the
functions read ``module.weight``/``module.bias`` and call the kernels, so the parameters stay the
model's own (trainable; gradients flow through the kernels' autograd).

Where the pieces live: ``dense_layer.py`` one decoder layer (attention, the gated MLP, their op
order and rounding points), ``primitives.py`` the ops on an HF module's parameters every family
uses (``linear``, ``rms_norm``, ``embed``, ``lm_head_logits``), ``fused_proj.py`` the engine's fused
q/k/v and gate/up copies, ``dense_tp.py`` the tensor-parallel layout; this module the spec read from
the config, the patched forwards and ``DenseFamily``. Their public names are importable from here too.

The optional ``recorder(name, tensor_or_tuple)`` is called after every op with names such as
``embed_tokens``, ``layers.1.self_attn.q_proj``, ``layers.1.mlp.down_proj``, ``norm``
(``bitmatch.verify.locate`` hashes them). It only observes: the forward runs the same ops with or
without it (the fused gate/up GEMM is recorded as its two halves).

Families that share this attention and differ in the MLP (``qwen3_moe``) subclass
``DenseFamily`` and override ``mlp`` / ``problems``.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import bitmatch.kernels as K
from bitmatch.context import ForwardContext
from bitmatch.models import dense_tp, fp8_mode, lora
from bitmatch.models.dense_layer import (
    LayerCall as LayerCall,
    attention as attention,
    decoder_layer as decoder_layer,
    gated_mlp as gated_mlp,
    paged_attention as paged_attention,
    rope_cos_sin as rope_cos_sin,
)
from bitmatch.models.fused_proj import (
    fused_copies as fused_copies,
    fused_linear as fused_linear,
    refresh_fused as refresh_fused,
)
from bitmatch.models.primitives import (
    embed as embed,
    fused_add_rms_norm as fused_add_rms_norm,
    linear as linear,
    lm_head_logits as lm_head_logits,
    norm_eps as norm_eps,
    plain_module as plain_module,
    rms_norm as rms_norm,
)
from bitmatch.models.registry import CacheGroup, Family, call_layer, register, tp_shard


@dataclass(frozen=True)
class DenseSpec:
    model_type: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    rope_base: float
    rope_scaling: dict | None
    max_position_embeddings: int | None
    qk_norm: bool
    sliding_windows: tuple
    scale: float
    vocab_size: int


def rope_params(cfg) -> tuple[float, dict | None]:
    """(base, scaling) from ``config.rope_parameters`` (transformers >= 5) or ``rope_theta``/``rope_scaling``."""
    rp = getattr(cfg, "rope_parameters", None)
    if isinstance(rp, dict) and rp:
        base = float(rp.get("rope_theta", getattr(cfg, "rope_theta", 10000.0)))
        rtype = rp.get("rope_type", rp.get("type", "default"))
        scaling = None if rtype in (None, "default") else dict(rp)
        return base, scaling
    base = float(getattr(cfg, "rope_theta", 10000.0))
    rs = getattr(cfg, "rope_scaling", None)
    if isinstance(rs, dict) and rs.get("rope_type", rs.get("type", "default")) not in (None, "default"):
        return base, dict(rs)
    return base, None


def _layer_sliding_window(cfg, layer, i: int):
    attn = layer.self_attn
    mt = cfg.model_type
    if mt == "llama":
        return None
    if hasattr(attn, "sliding_window"):  # Qwen2/Qwen3 (transformers >= 4.5x): set only on sliding layers
        return attn.sliding_window
    sw = getattr(cfg, "sliding_window", None)
    if mt == "mistral":
        return sw
    lt = getattr(cfg, "layer_types", None)
    if lt is not None:
        return sw if lt[i] == "sliding_attention" else None
    if getattr(cfg, "use_sliding_window", False) and i >= getattr(cfg, "max_window_layers", 0):
        return sw
    return None


# ----------------------------------------------------------------------------- patched forwards

def _layer_forward(self, hidden_states=None, residual=None, cos=None, sin=None, *, bm: LayerCall | None = None,
                   state=None, **kwargs):
    if bm is None:
        raise RuntimeError("bitmatch: a patched decoder layer runs only inside bitmatch's forward "
                           "(call the causal LM, bitmatch.token_logprobs or bitmatch.models.forward_hidden)")
    return decoder_layer(self, hidden_states, residual, cos, sin, bm=bm)


def _attn_forward(self, *args, state=None, **kwargs):
    raise RuntimeError("bitmatch: a patched attention module runs only inside bitmatch's forward "
                       "(it needs the packed ForwardContext); call the causal LM instead")


def _norm_forward(self, x, *, state):
    return rms_norm(self, x, state.compute_dtype or self.weight.dtype)


class DenseFamily(Family):
    name = "dense"
    model_types = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                   "llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM"}
    quantizations = ("fp8",)  # projections on block-FP8 weights (fp8_mode); Qwen3-MoE inherits it
    packed_modules = (
        ("self_attn.qkv_proj", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
        ("mlp.gate_up_proj", ("mlp.gate_proj", "mlp.up_proj")),
    )
    vllm_supported = True
    # tiny shapes covering head_dim 64 / 128, GQA 1 / 4 / 8, tied and untied embeddings, RoPE
    # scaling, sliding windows; small, since the CPU reference kernels are slow
    tiny_configs = {
        # Qwen3: q/k norms, head_dim 64, GQA 4, tied embeddings (the demo's shape)
        "qwen3-hd64-gqa4-tied": ("qwen3", dict(num_attention_heads=4, num_key_value_heads=1, head_dim=64,
                                               tie_word_embeddings=True)),
        # Qwen2: q/k/v bias, GQA 1, untied, sliding window on layer 1 (use_sliding_window)
        "qwen2-hd64-gqa1-bias-sw": ("qwen2", dict(num_attention_heads=2, num_key_value_heads=2, head_dim=64,
                                                  use_sliding_window=True, sliding_window=8, max_window_layers=1)),
        # Llama: head_dim 128, GQA 8, llama3 RoPE scaling, untied
        "llama-hd128-gqa8-llama3rope": ("llama", dict(num_attention_heads=8, num_key_value_heads=1, head_dim=128,
                                                      rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0,
                                                                       "factor": 8.0, "low_freq_factor": 1.0,
                                                                       "high_freq_factor": 4.0,
                                                                       "original_max_position_embeddings": 32})),
        # Mistral: head_dim 128, GQA 4, sliding window 8, tied
        "mistral-hd128-gqa4-sw": ("mistral", dict(num_attention_heads=4, num_key_value_heads=1, head_dim=128,
                                                  sliding_window=8, tie_word_embeddings=True)),
        # Qwen3 with linear RoPE scaling, head_dim 128, GQA 1
        "qwen3-hd128-gqa1-linearrope": ("qwen3", dict(num_attention_heads=2, num_key_value_heads=2, head_dim=128,
                                                      rope_parameters={"rope_type": "linear",
                                                                       "rope_theta": 1000000.0, "factor": 4.0})),
    }

    def tiny_config(self, name: str | None = None, **overrides):
        """A ``tiny_configs`` shape, or the base tiny config of one of ``model_types`` (hidden 128,
        2 layers, 4 heads, 2 KV heads, head_dim 64, vocabulary 128, untied)."""
        import transformers  # a third-party import, deferred: only tiny models need the config classes

        name = self.tiny_name(name)
        model_type = name
        if name in self.tiny_configs:
            model_type, extra = self.tiny_configs[name]
            overrides = {**extra, **overrides}
        kw = dict(vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=1024,
                  rms_norm_eps=1e-6, tie_word_embeddings=False, initializer_range=0.1,
                  pad_token_id=0, bos_token_id=1, eos_token_id=2)
        if model_type == "mistral":
            kw["sliding_window"] = None
        kw.update(overrides)
        rope = kw.pop("rope_parameters", None)
        cfg_cls = transformers.CONFIG_MAPPING[model_type]
        if rope is None:
            return cfg_cls(**kw)
        try:
            return cfg_cls(rope_parameters=rope, **kw)
        except TypeError:  # older transformers: rope_scaling + rope_theta
            rope = dict(rope)
            theta = rope.pop("rope_theta", 10000.0)
            return cfg_cls(rope_scaling=rope, rope_theta=theta, **kw)

    def problems(self, config) -> list[str]:
        out = []
        act = getattr(config, "hidden_act", "silu")
        if act not in ("silu", "swish"):
            out.append(f"hidden_act={act!r} (only silu)")
        prf = getattr(config, "partial_rotary_factor", 1.0)
        if prf not in (None, 1.0, 1):
            out.append(f"partial_rotary_factor={prf} (only 1.0)")
        rp = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
        rtype = rp.get("rope_type", rp.get("type", "default")) if isinstance(rp, dict) else "default"
        if rtype not in (None, *K.SUPPORTED_ROPE_TYPES):
            out.append(f"rope_type={rtype!r} (supported: {', '.join(K.SUPPORTED_ROPE_TYPES)})")
        return out

    def build_spec(self, lm) -> DenseSpec:
        cfg = lm.config
        layers = lm.model.layers[: cfg.num_hidden_layers]
        a0 = layers[0].self_attn
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        head_dim = getattr(a0, "head_dim", head_dim)
        base, scaling = rope_params(cfg)
        spec = DenseSpec(
            model_type=cfg.model_type,
            num_layers=len(layers),
            num_heads=cfg.num_attention_heads,
            num_kv_heads=getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads,
            head_dim=head_dim,
            hidden_size=cfg.hidden_size,
            rope_base=base,
            rope_scaling=scaling,
            max_position_embeddings=getattr(cfg, "max_position_embeddings", None),
            qk_norm=hasattr(a0, "q_norm"),
            sliding_windows=tuple(_layer_sliding_window(cfg, layer, i) for i, layer in enumerate(layers)),
            scale=float(getattr(a0, "scaling", head_dim ** -0.5)),
            vocab_size=lm.lm_head.weight.shape[0],
        )
        tp = tp_shard(lm)  # duck-typed: this module never imports bitmatch.parallel
        return spec if tp is None else replace(spec, num_kv_heads=tp.kv_heads)  # a TP rank caches its KV heads

    def cache_groups(self, spec: DenseSpec, dtype) -> list[CacheGroup]:
        return [CacheGroup("kv", "paged_kv", tuple(range(spec.num_layers)), spec.num_kv_heads, spec.head_dim, dtype)]

    def mlp(self, mlp_mod, x, dtype, rec=None, prefix="mlp", fuse: bool = False, share=None):
        return gated_mlp(mlp_mod, x, dtype, rec, prefix, fuse=fuse, share=share)

    def shard(self, lm, sharder):
        """This rank's tensor-parallel layout (``dense_tp``: heads, MLP columns, vocab rows)."""
        return dense_tp.shard(self, lm, self.build_spec(lm), sharder)

    def shard_mlp(self, mlp_mod, sharder, hidden: int, prefix: str):
        """A layer's MLP share (``dense_tp``): gate/up by intermediate columns, down_proj row-parallel."""
        return dense_tp.gated_mlp_share(mlp_mod, sharder, hidden, prefix)

    def cuda_graph_safe(self, lm) -> bool:
        """The engine may capture this family's decode steps in CUDA graphs: true for the dense
        forward itself (every op sync-free given the context's host bounds); a subclass that
        overrides the forward or the MLP must opt in by overriding this."""
        cls = type(self)
        return (cls.forward_hidden is DenseFamily.forward_hidden and cls.mlp is DenseFamily.mlp
                and lora.graph_capturable(lm) and tp_shard(lm) is None)

    def refresh_derived_weights(self, lm, force: bool = False) -> None:
        """The fused q/k/v, gate/up copies and LoRA layers' kept merged weights brought up to date
        in place (before a graph replay; ``force``: rebuilt whatever the version counters say)."""
        refresh_fused(lm, force)
        lora.refresh_rollout_weights(lm, force)
        fp8_mode.refresh(lm, force)

    def forward_hidden(self, lm, spec: DenseSpec, input_ids, ctx: ForwardContext, dtype, recorder=None):
        tp = tp_shard(lm)
        if tp is not None:
            return tp.forward_hidden(input_ids, ctx, recorder)
        return self.run(lm, spec, input_ids, ctx, dtype, recorder)

    def run(self, lm, spec: DenseSpec, input_ids, ctx: ForwardContext, dtype, recorder=None, shares=None):
        """The forward; ``shares``: a tensor-parallel rank's ``dense_tp.LayerShare`` per layer."""
        # the engine's paged steps read LoRA layers' kept merged weights (bitmatch.models.lora)
        with lora.kept_weights(ctx.paged):
            return self._forward_hidden(lm, spec, input_ids, ctx, dtype, recorder, shares)

    def _forward_hidden(self, lm, spec: DenseSpec, input_ids, ctx: ForwardContext, dtype, recorder=None, shares=None):
        h = embed(lm, input_ids, dtype)
        if recorder is not None:
            recorder("embed_tokens", h)
        cos, sin = rope_cos_sin(ctx, spec.head_dim, spec.rope_base, spec.rope_scaling,
                                spec.max_position_embeddings)
        residual = None
        for i, layer in enumerate(lm.model.layers[: spec.num_layers]):
            bm = LayerCall(self, ctx, spec, i, dtype, recorder, None if shares is None else shares[i])
            h, residual = call_layer(layer, decoder_layer, (h, residual, cos, sin), bm)
        if residual is None:  # no layers
            out = rms_norm(lm.model.norm, h, dtype)
        else:
            out, _ = fused_add_rms_norm(lm.model.norm, h, residual, dtype)
        if recorder is not None:
            recorder("norm", out)
        return out

    def compute_logits(self, lm, spec, hidden, dtype):
        tp = tp_shard(lm)
        return lm_head_logits(lm, hidden, dtype) if tp is None else tp.compute_logits(hidden)

    def patch_modules(self, lm):
        mods = [(lm.model.norm, _norm_forward)]
        for layer in lm.model.layers:
            mods += [(layer, _layer_forward), (layer.self_attn, _attn_forward),
                     (layer.input_layernorm, _norm_forward), (layer.post_attention_layernorm, _norm_forward)]
            mods += [(getattr(layer.self_attn, n), _norm_forward) for n in ("q_norm", "k_norm")
                     if hasattr(layer.self_attn, n)]
            mods += self.patch_mlp(layer.mlp)
        return mods

    def patch_mlp(self, mlp_mod):
        return [(mlp_mod, _mlp_forward)]


def _mlp_forward(self, x, *, state):
    return gated_mlp(self, x, state.compute_dtype or self.gate_proj.weight.dtype)


FAMILY = register(DenseFamily())
