"""The dense decoder (Qwen2, Qwen3, Llama, Mistral) written once on bitmatch.kernels.

Every path that computes a token's logits runs these functions in this order: the trainer
(``bitmatch.token_logprobs``), the patched HF forward (``bitmatch.patch``) and the embedded
engine (``bitmatch.Engine`` through ``forward_hidden``). The HF modules are only parameter
holders here: the functions read ``module.weight``/``module.bias`` and call the kernels, so
the parameters stay the model's own (trainable; gradients flow through the kernels' autograd).

Op order of one decoder layer (rounding points as HF's):
    x, residual = rms_norm(h)                  (layer 0: residual = embedding)
                | fused_add_rms_norm(h, residual)
    q, k, v = linear(x, Wq/Wk/Wv [+ bias])     -> [T, H, D]
    q, k = rms_norm(q, Wqn), rms_norm(k, Wkn)  (Qwen3 only, on head_dim)
    q, k = apply_rotary(q, k, cos, sin)        (cos/sin fp32 from rotary_cos_sin(positions))
    a = attention_prefill(...) | write_kv_cache + attention_paged(...)   (per-layer sliding window)
    a = linear(a, Wo)
    x, residual = fused_add_rms_norm(a, residual, W_post)
    m = linear(silu_and_mul(cat(linear(x, Wg), linear(x, Wu))), Wd)
    -> (m, residual) to the next layer; final: fused_add_rms_norm(m, residual, W_norm)
Weights are cast with ``bitmatch.precision.compute_cast`` at use time when the parameter
dtype differs from the compute dtype (fp32 master, bf16 compute).

The optional ``recorder(name, tensor_or_tuple)`` is called after every op with names such as
``embed_tokens``, ``layers.1.self_attn.q_proj``, ``layers.1.mlp.down_proj``, ``norm``
(``bitmatch.verify.locate`` hashes them).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Callable

import torch
import torch.nn.functional as F

from bitmatch.context import ForwardContext, set_forward_context
from bitmatch.precision import compute_cast

SUPPORTED_ARCHITECTURES = {
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
}

Recorder = Callable[[str, object], None]


def _kernels():
    import bitmatch.kernels as K  # late import: the kernels package may load a backend

    return K


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


@dataclass(frozen=True)
class KVCacheSpec:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype


def supported_message() -> str:
    return ", ".join(f"{v} (model_type {k!r})" for k, v in SUPPORTED_ARCHITECTURES.items())


def check_supported(lm) -> None:
    """Raise ValueError naming the supported architectures unless ``lm`` is one of them."""
    cfg = getattr(lm, "config", None)
    mt = getattr(cfg, "model_type", None)
    arch = type(lm).__name__
    if mt not in SUPPORTED_ARCHITECTURES or not hasattr(lm, "lm_head") or not hasattr(getattr(lm, "model", None), "layers"):
        raise ValueError(
            f"bitmatch: unsupported architecture {arch} (model_type {mt!r}); supported: {supported_message()}"
        )
    act = getattr(cfg, "hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise ValueError(f"bitmatch: {arch} with hidden_act={act!r} is not supported (only silu)")
    prf = getattr(cfg, "partial_rotary_factor", 1.0)
    if prf not in (None, 1.0, 1):
        raise ValueError(f"bitmatch: {arch} with partial_rotary_factor={prf} is not supported")


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


def model_spec(lm) -> DenseSpec:
    check_supported(lm)
    cfg = lm.config
    layers = lm.model.layers[: cfg.num_hidden_layers]
    a0 = layers[0].self_attn
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    head_dim = getattr(a0, "head_dim", head_dim)
    base, scaling = rope_params(cfg)
    sws = tuple(_layer_sliding_window(cfg, layer, i) for i, layer in enumerate(layers))
    return DenseSpec(
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
        sliding_windows=sws,
        scale=float(getattr(a0, "scaling", head_dim ** -0.5)),
    )


def default_compute_dtype(lm) -> torch.dtype:
    dt = getattr(lm, "_bitmatch_compute_dtype", None)
    return dt if dt is not None else lm.model.embed_tokens.weight.dtype


# ----------------------------------------------------------------------------- primitives

def cast_param(p: torch.Tensor | None, dtype: torch.dtype):
    if p is None or p.dtype == dtype:
        return p
    return compute_cast(p, dtype)


def _plain_linear_params(mod):
    if hasattr(mod, "base_layer") or hasattr(mod, "lora_A"):
        raise ValueError(
            f"bitmatch: {type(mod).__name__} is a PEFT adapter layer with unmerged adapters; merge the "
            "adapters (peft merge_adapter) before running it on bitmatch kernels"
        )
    return mod.weight, getattr(mod, "bias", None)


def linear(mod, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if hasattr(mod, "lora_A") and hasattr(mod, "base_layer"):
        # PEFT LoRA: the merged weight the rollout receives (bitmatch.adapters.lora)
        from bitmatch.adapters import lora
        return lora.linear(mod, x, dtype)
    w, b = _plain_linear_params(mod)
    return _kernels().linear(x, cast_param(w, dtype), cast_param(b, dtype))


def _eps(norm_mod) -> float:
    for name in ("variance_epsilon", "eps"):
        if hasattr(norm_mod, name):
            return float(getattr(norm_mod, name))
    raise ValueError(f"bitmatch: cannot find eps on norm module {type(norm_mod).__name__}")


def rms_norm(norm_mod, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return _kernels().rms_norm(x, cast_param(norm_mod.weight, dtype), _eps(norm_mod))


def fused_add_rms_norm(norm_mod, x, residual, dtype):
    return _kernels().fused_add_rms_norm(x, residual, cast_param(norm_mod.weight, dtype), _eps(norm_mod))


def embed(lm, input_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    emb = lm.model.embed_tokens
    w = emb.weight
    h = F.embedding(input_ids, w)  # exact gather; cast after gather == gather after cast
    if torch.is_grad_enabled() and not h.requires_grad and getattr(emb, "_forward_hooks", None) and \
            getattr(lm, "_require_grads_hooks", None):
        # HF enable_input_require_grads (PEFT + reentrant checkpointing) hooks the embedding module,
        # which this gather bypasses: do what its hook does
        h.requires_grad_(True)
    return cast_param(h, dtype)


def mlp(mlp_mod, x: torch.Tensor, dtype: torch.dtype, rec: Recorder | None = None, prefix: str = "mlp"):
    g = linear(mlp_mod.gate_proj, x, dtype)
    u = linear(mlp_mod.up_proj, x, dtype)
    if rec is not None:
        rec(f"{prefix}.gate_proj", g)
        rec(f"{prefix}.up_proj", u)
    a = _kernels().silu_and_mul(torch.cat([g, u], dim=-1))
    if rec is not None:
        rec(f"{prefix}.act_fn", a)
    y = linear(mlp_mod.down_proj, a, dtype)
    if rec is not None:
        rec(f"{prefix}.down_proj", y)
    return y


def attention(attn, x, cos, sin, ctx: ForwardContext, spec: DenseSpec, layer_idx: int, dtype,
              rec: Recorder | None = None, prefix: str = "self_attn"):
    K = _kernels()
    T = x.shape[0]
    D = spec.head_dim
    q = linear(attn.q_proj, x, dtype).view(T, -1, D)
    k = linear(attn.k_proj, x, dtype).view(T, -1, D)
    v = linear(attn.v_proj, x, dtype).view(T, -1, D)
    if rec is not None:
        rec(f"{prefix}.q_proj", q)
        rec(f"{prefix}.k_proj", k)
        rec(f"{prefix}.v_proj", v)
    if spec.qk_norm:
        q = rms_norm(attn.q_norm, q, dtype)
        k = rms_norm(attn.k_norm, k, dtype)
        if rec is not None:
            rec(f"{prefix}.q_norm", q)
            rec(f"{prefix}.k_norm", k)
    q, k = K.apply_rotary(q, k, cos, sin)
    if rec is not None:
        rec(f"{prefix}.rotary", (q, k))
    sw = spec.sliding_windows[layer_idx]
    if ctx.paged:
        if ctx.kv_caches is None:
            raise ValueError("bitmatch: paged ForwardContext without kv_caches")
        k_cache, v_cache = ctx.kv_caches[layer_idx]
        K.write_kv_cache(k, v, k_cache, v_cache, ctx.slot_mapping)
        o = K.attention_paged(q, k_cache, v_cache, ctx.block_table, ctx.query_start_loc, ctx.seq_lens,
                              spec.scale, sliding_window=sw)
    else:
        if ctx.cu_seqlens is None:
            raise ValueError("bitmatch: ForwardContext needs cu_seqlens (packed prefill) or slot_mapping (paged)")
        o = K.attention_prefill(q, k, v, ctx.cu_seqlens, spec.scale, causal=True, sliding_window=sw)
    if rec is not None:
        rec(f"{prefix}.attn", o)
    o = linear(attn.o_proj, o.reshape(T, -1), dtype)
    if rec is not None:
        rec(f"{prefix}.o_proj", o)
    return o


@dataclass
class LayerCall:
    """What a decoder layer needs besides its tensors (captured, so a checkpoint replay sees it)."""
    ctx: ForwardContext
    spec: DenseSpec
    layer_idx: int
    dtype: torch.dtype
    recorder: Recorder | None = None


def decoder_layer(layer, h, residual, cos, sin, *, bm: LayerCall):
    """One decoder layer: returns (mlp_out, residual); the next norm adds them (fused)."""
    i, dt, rec = bm.layer_idx, bm.dtype, bm.recorder
    p = f"layers.{i}"
    if residual is None:
        residual = h
        x = rms_norm(layer.input_layernorm, h, dt)
    else:
        x, residual = fused_add_rms_norm(layer.input_layernorm, h, residual, dt)
    if rec is not None:
        rec(f"{p}.input_layernorm", (x, residual))
    a = attention(layer.self_attn, x, cos, sin, bm.ctx, bm.spec, i, dt, rec, f"{p}.self_attn")
    x, residual = fused_add_rms_norm(layer.post_attention_layernorm, a, residual, dt)
    if rec is not None:
        rec(f"{p}.post_attention_layernorm", (x, residual))
    m = mlp(layer.mlp, x, dt, rec, f"{p}.mlp")
    return m, residual


def _checkpointing(layer) -> bool:
    return bool(getattr(layer, "gradient_checkpointing", False)) and layer.training and torch.is_grad_enabled()


def forward_hidden_lm(lm, input_ids: torch.Tensor, ctx: ForwardContext, *, compute_dtype=None,
                      recorder: Recorder | None = None) -> torch.Tensor:
    """forward_hidden on an already unwrapped causal LM (see bitmatch.models.forward_hidden)."""
    spec = model_spec(lm)
    if input_ids.dim() != 1:
        raise ValueError(f"forward_hidden: input_ids must be 1-D packed tokens [T], got shape {tuple(input_ids.shape)}")
    if ctx.positions is None or ctx.positions.shape[0] != input_ids.shape[0]:
        raise ValueError("forward_hidden: ctx.positions must have one entry per token of input_ids")
    dt = compute_dtype if compute_dtype is not None else default_compute_dtype(lm)
    K = _kernels()
    h = embed(lm, input_ids, dt)
    if recorder is not None:
        recorder("embed_tokens", h)
    cos, sin = K.rotary_cos_sin(ctx.positions, spec.head_dim, spec.rope_base, spec.rope_scaling,
                                dtype=torch.float32, max_position_embeddings=spec.max_position_embeddings)
    residual = None
    with set_forward_context(ctx):
        for i, layer in enumerate(lm.model.layers[: spec.num_layers]):
            bm = LayerCall(ctx, spec, i, dt, recorder)
            if getattr(layer, "_bitmatch_patched", False):
                # through the module's __call__: HF gradient checkpointing, FSDP/forward hooks
                h, residual = layer(h, residual, cos, sin, bm=bm)
            elif _checkpointing(layer):
                h, residual = layer._gradient_checkpointing_func(partial(decoder_layer, layer, bm=bm),
                                                                 h, residual, cos, sin)
            else:
                h, residual = decoder_layer(layer, h, residual, cos, sin, bm=bm)
        if residual is None:  # no layers
            out = rms_norm(lm.model.norm, h, dt)
        else:
            out, _ = fused_add_rms_norm(lm.model.norm, h, residual, dt)
    if recorder is not None:
        recorder("norm", out)
    return out


def compute_logits_lm(lm, hidden: torch.Tensor, *, compute_dtype=None) -> torch.Tensor:
    dt = compute_dtype if compute_dtype is not None else default_compute_dtype(lm)
    head = lm.lm_head
    w, b = _plain_linear_params(head)
    return _kernels().linear(hidden, cast_param(w, dt), cast_param(b, dt))


def kv_cache_spec_lm(lm, *, compute_dtype=None) -> KVCacheSpec:
    s = model_spec(lm)
    dt = compute_dtype if compute_dtype is not None else default_compute_dtype(lm)
    return KVCacheSpec(num_layers=s.num_layers, num_kv_heads=s.num_kv_heads, head_dim=s.head_dim, dtype=dt)
