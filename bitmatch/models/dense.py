"""The dense decoder family (Qwen2, Qwen3, Llama, Mistral) written once on bitmatch.kernels.

Every path that computes a token's logits runs these functions in this order: the trainer
(``bitmatch.token_logprobs``), the patched HF forward (``bitmatch.patch``), the embedded engine
(``bitmatch.Engine``) and the vLLM plugin. The HF modules are only parameter holders here: the
functions read ``module.weight``/``module.bias`` and call the kernels, so the parameters stay the
model's own (trainable; gradients flow through the kernels' autograd).

Op order of one decoder layer (rounding points as HF's):
    x, residual = rms_norm(h)                  (layer 0: residual = embedding)
                | fused_add_rms_norm(h, residual)
    q, k, v = linear(x, Wq/Wk/Wv [+ bias])     -> [T, H, D]
    q, k = rms_norm(q, Wqn), rms_norm(k, Wkn)  (Qwen3 only, on head_dim)
    q, k = apply_rotary(q, k, cos, sin)        (cos/sin fp32 from rotary_cos_sin(positions))
    a = attention_prefill(...) | write_kv_cache + attention_paged(...)   (per-layer sliding window)
    a = linear(a, Wo)
    x, residual = fused_add_rms_norm(a, residual, W_post)
    m = family.mlp(x): linear(silu_and_mul(cat(linear(x, Wg), linear(x, Wu))), Wd)
    -> (m, residual) to the next layer; final: fused_add_rms_norm(m, residual, W_norm)
Weights are cast with ``bitmatch.precision.compute_cast`` at use time when the parameter
dtype differs from the compute dtype (fp32 master, bf16 compute).

The optional ``recorder(name, tensor_or_tuple)`` is called after every op with names such as
``embed_tokens``, ``layers.1.self_attn.q_proj``, ``layers.1.mlp.down_proj``, ``norm``
(``bitmatch.verify.locate`` hashes them). It only observes: the forward runs the same ops with or
without it (the fused gate/up GEMM is recorded as its two halves).

Families that share this attention and differ in the MLP (``qwen3_moe``) subclass
``DenseFamily`` and override ``mlp`` / ``problems``.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

import bitmatch.kernels as K
from bitmatch.context import ForwardContext
from bitmatch.models import dense_tp, fp8_mode, lora
from bitmatch.models.registry import CacheGroup, Family, Recorder, call_layer, register, tp_shard
from bitmatch.models.state import create_state, get_state
from bitmatch.precision import cast_param


def _kernels():
    """The kernels package: ops are read as ``K.op`` at call time (``kernels.override`` swaps them)."""
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


# ----------------------------------------------------------------------------- primitives

def plain_module(mod, what: str):
    """``mod`` when no PEFT adapter wraps it, else a ValueError naming it: the families read the
    parameters of such modules (routers, experts, lm_head, V4's grouped o_a_proj) directly, so an
    adapter there would be ignored, not reproduced. LoRA runs on the projections that go through
    ``linear`` below."""
    if hasattr(mod, "base_layer") or hasattr(mod, "lora_A"):
        raise ValueError(
            f"bitmatch: a PEFT adapter wraps {what} ({type(mod).__name__}); bitmatch reads its weights "
            "directly and would ignore the adapter: remove it from LoraConfig target_modules / "
            "target_parameters (LoRA runs on the attention and MLP projections), or merge the adapters "
            "(peft merge_adapter) first")
    return mod


def _plain_linear_params(mod, what: str = "a layer bitmatch reads directly"):
    mod = plain_module(mod, what)
    return mod.weight, getattr(mod, "bias", None)


def linear(mod, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if fp8_mode.active():  # quantization="fp8": every projection on block-FP8 weights
        return fp8_mode.linear(mod, x, dtype)
    if lora.is_lora_layer(mod):
        return lora.linear(mod, x, dtype)  # PEFT LoRA: the merged weight the rollout receives
    w, b = _plain_linear_params(mod)
    return _kernels().linear(x, cast_param(w, dtype), cast_param(b, dtype))


def norm_eps(norm_mod) -> float:
    """The epsilon of an HF RMSNorm module (``variance_epsilon`` or ``eps``)."""
    for name in ("variance_epsilon", "eps"):
        if hasattr(norm_mod, name):
            return float(getattr(norm_mod, name))
    raise ValueError(f"bitmatch: cannot find eps on norm module {type(norm_mod).__name__}")


def rms_norm(norm_mod, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return _kernels().rms_norm(x, cast_param(norm_mod.weight, dtype), norm_eps(norm_mod))


def fused_add_rms_norm(norm_mod, x, residual, dtype):
    return _kernels().fused_add_rms_norm(x, residual, cast_param(norm_mod.weight, dtype), norm_eps(norm_mod))


def embed(lm, input_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    emb = plain_module(lm.model.embed_tokens, "the token embeddings (embed_tokens)")
    w = emb.weight
    # exact gather (cast after gather == gather after cast); padding_idx as nn.Embedding has it:
    # the pad row gets no gradient (HF configs set it from pad_token_id)
    h = F.embedding(input_ids, w, padding_idx=getattr(emb, "padding_idx", None))
    if torch.is_grad_enabled() and not h.requires_grad and getattr(emb, "_forward_hooks", None) and \
            getattr(lm, "_require_grads_hooks", None):
        # HF enable_input_require_grads (PEFT + reentrant checkpointing) hooks the embedding module,
        # which this gather bypasses: do what its hook does
        h.requires_grad_(True)
    return cast_param(h, dtype)


# ----------------------------------------------------------------------------- fused projections
# Inference only (no autograd recording): q/k/v and gate/up as one GEMM each on a concatenated
# copy of the HF weights, which stay the source of truth. kernels.linear(segments=) gives each
# segment the bits of its own linear, so fusing changes no bit. The copy is keyed on the weights'
# data_ptr (a replaced tensor: new copy) and _version (an in-place update, an optimizer step or
# a weight sync: recomputed in place, so a captured CUDA graph reading it stays valid). It lives in
# the parent module's ModelState (``derived``), so it goes with the module.


# A PEFT LoRA layer joins a fused copy in the engine's kept-weights steps: its part is the cast
# merged weight (lora.fused_part: the bits of its kept rollout weight), keyed on W, A, B, the live
# adapters, their scalings and the base bias (lora.fused_key). The fused copy then IS the kept
# weight (not a second copy), and the LoRA model's projections run as the merged model's do.


def _part(m, dtype):
    if lora.is_lora_layer(m):
        return lora.fused_part(m, dtype)
    return cast_param(m.weight, dtype), getattr(m, "bias", None)


def _part_key(m):
    if lora.is_lora_layer(m):
        return lora.fused_key(m)
    b = getattr(m, "bias", None)
    return (m.weight.data_ptr(), m.weight._version), None if b is None else (b.data_ptr(), b._version)


class _FusedEntry:
    __slots__ = ("mods", "dtype", "key", "weight", "bias", "segments")

    def versions(self):
        return tuple(_part_key(m) for m in self.mods)

    def build(self, out=None):
        parts = [_part(m, self.dtype) for m in self.mods]
        ws = [w for w, _ in parts]
        shape = (sum(w.shape[0] for w in ws), ws[0].shape[1])
        # in place while the shape holds: a captured graph reads this address
        self.weight = torch.cat(ws, 0, out=out) if out is not None and out.shape == shape else torch.cat(ws, 0)
        bs = [b for _, b in parts]
        self.bias = None if bs[0] is None else torch.cat([cast_param(b, self.dtype) for b in bs], 0)
        self.key = self.versions()

    def refresh(self, force: bool = False, key=None):
        if (self.versions() if key is None else key) == self.key and not force:
            return
        self.build(out=self.weight)


def _fused_weight(parent, name: str, mods, dtype):
    """(weight, bias, segments) of ``mods`` fused, or None when fusing does not apply (autograd
    records: the trainer keeps its separate parameters; PEFT layers outside the engine's
    kept-weights steps or that the LoRA linear cannot run; mixed bias)."""
    # (inference mode, e.g. inside vLLM: its tensors carry no _version to key the copy on)
    if torch.is_grad_enabled() or torch.is_inference_mode_enabled():
        return None
    if fp8_mode.active():  # FP8 mode quantizes each projection on its own: no fused copy
        return None
    for m in mods:  # LoRA layers only where the engine reads kept weights; other PEFT layers never
        if lora.is_lora_layer(m):
            if not lora.fusable(m):
                return None
        elif hasattr(m, "base_layer") or hasattr(m, "lora_A"):
            return None
    key = tuple(_part_key(m) for m in mods)
    if len({k[1] is None for k in key}) != 1:  # mixed bias
        return None
    per = create_state(parent).derived
    e = per.get(name)
    if e is None or e.dtype != dtype or any(a is not b for a, b in zip(e.mods, mods)):
        e = _FusedEntry()
        e.mods, e.dtype = tuple(mods), dtype
        e.segments = tuple(m.weight.shape[0] for m in mods)
        e.build()
        per[name] = e
    else:
        e.refresh(key=key)
    return e.weight, e.bias, e.segments


def refresh_fused(lm, force: bool = False) -> None:
    """Bring every fused copy of ``lm``'s layers up to date in place (before a CUDA graph replay,
    which runs no host code). ``force``: rebuild even where the version counters did not move (a
    write through ``param.data`` bumps no counter; the engine forces a rebuild whenever it starts
    work after being idle, so such a write between generate() calls is seen)."""
    for layer in lm.model.layers:
        for parent in (layer.self_attn, layer.mlp):
            for e in fused_copies(parent).values():
                e.refresh(force)


def fused_copies(parent) -> dict:
    """``{name: fused copy}`` the engine derived from ``parent``'s projections (empty if none)."""
    st = get_state(parent)
    return {} if st is None else st.derived


def fused_linear(parent, name, mods, x, dtype, fuse: bool = True):
    """The outputs of ``linear(m, x)`` for each of ``mods``: one GEMM when fusable, same bits."""
    f = _fused_weight(parent, name, mods, dtype) if fuse else None
    if f is None:
        return [linear(m, x, dtype) for m in mods]
    w, b, segs = f
    y = _kernels().linear(x, w, b, segments=segs)
    return list(torch.split(y, segs, dim=-1))


def lm_head_logits(lm, hidden: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Logits [N, vocab] of ``lm.lm_head`` on kernels.linear, weights cast at use (every family's head;
    a row's bits do not depend on the other rows)."""
    w, b = _plain_linear_params(lm.lm_head, "lm_head")
    return _kernels().linear(hidden, cast_param(w, dtype), cast_param(b, dtype))


def gated_mlp(mlp_mod, x: torch.Tensor, dtype: torch.dtype, rec: Recorder | None = None, prefix: str = "mlp",
              fuse: bool = False, share=None):
    """``fuse``: gate/up as one GEMM on the fused copy (the engine's paged steps only: the engine
    rebuilds the copies whenever it starts work, so a weight written behind autograd's back, e.g.
    through ``param.data`` or by an optimizer, cannot leave a stale copy in a trainer forward).
    ``share``: a tensor-parallel rank's ``dense_tp.MlpShare`` (its intermediate columns, down_proj
    row-parallel): the same ops in the same order on the rank's columns."""
    f = _fused_weight(mlp_mod, "gate_up", (mlp_mod.gate_proj, mlp_mod.up_proj), dtype) if fuse and not share else None
    if share is not None:
        x = share.enter(x)
        g, u, gu = share.gate(x), share.up(x), None
    elif f is not None:  # [g | u] as one GEMM: exactly the cat below, without the copy
        w, b, segs = f
        gu = _kernels().linear(x, w, b, segments=segs)
        g, u = gu[:, :segs[0]], gu[:, segs[0]:]   # views for a recorder: the step runs what it runs unrecorded
    else:
        g = linear(mlp_mod.gate_proj, x, dtype)
        u = linear(mlp_mod.up_proj, x, dtype)
        gu = None
    if rec is not None:
        rec(f"{prefix}.gate_proj", g)
        rec(f"{prefix}.up_proj", u)
    a = _kernels().silu_and_mul(torch.cat([g, u], dim=-1) if gu is None else gu)
    if rec is not None:
        rec(f"{prefix}.act_fn", a)
    y = linear(mlp_mod.down_proj, a, dtype) if share is None else share.down(a)
    if rec is not None:
        rec(f"{prefix}.down_proj", y)
    return y


def attention(attn, x, cos, sin, ctx: ForwardContext, spec: DenseSpec, layer_idx: int, dtype,
              rec: Recorder | None = None, prefix: str = "self_attn", share=None):
    """``share``: a tensor-parallel rank's ``dense_tp.AttentionShare`` (its heads; o_proj row-parallel)."""
    K = _kernels()
    T = x.shape[0]
    D = spec.head_dim
    if share is None:  # fused only in the engine's paged steps (see gated_mlp)
        q, k, v = fused_linear(attn, "qkv", (attn.q_proj, attn.k_proj, attn.v_proj), x, dtype, fuse=ctx.paged)
    else:
        x = share.enter(x)
        q, k, v = share.q(x), share.k(x), share.v(x)
    q, k, v = q.reshape(T, -1, D), k.reshape(T, -1, D), v.reshape(T, -1, D)
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
        k_cache, v_cache = ctx.cache("kv", layer_idx)
        K.write_kv_cache(k, v, k_cache, v_cache, ctx.slot_mapping)
        o = paged_attention(K, q, k, v, k_cache, v_cache, ctx, spec.scale, sw)
    else:
        if ctx.cu_seqlens is None:
            raise ValueError("bitmatch: ForwardContext needs cu_seqlens (packed prefill) or slot_mapping (paged)")
        # the host's longest sequence (pack's metadata) sizes the grid: no read of cu_seqlens back
        o = K.attention_prefill(q, k, v, ctx.cu_seqlens, spec.scale, causal=True, sliding_window=sw,
                                max_seqlen=ctx.max_query_len)
    if rec is not None:
        rec(f"{prefix}.attn", o)
    o = linear(attn.o_proj, o.reshape(T, -1), dtype) if share is None else share.o(o.reshape(T, -1))
    if rec is not None:
        rec(f"{prefix}.o_proj", o)
    return o


def paged_attention(K, q, k, v, k_cache, v_cache, ctx: ForwardContext, scale, sw=None):
    """The paged step's attention (K/V already written): a step of fresh prefills (no cached
    prefix) attends over its own contiguous K/V with attention_prefill, with no per-token gather
    through the block table; any other step through attention_paged, given the context's host
    bounds when it has them (a decode step then reads nothing back: graph capture). Same bits
    either way (the kernels share the canonical KV-block order: tests/test_engine_prefill_fast.py).
    Shared by every family with plain paged attention (dense, Qwen3-MoE, Nemotron-H)."""
    if ctx.fresh_prefill and ctx.max_query_len is not None:
        return K.attention_prefill(q, k, v, ctx.query_start_loc, scale, causal=True, sliding_window=sw,
                                   max_seqlen=ctx.max_query_len)
    host = {} if ctx.max_seq_len is None or ctx.max_query_len is None else dict(
        max_query_len=ctx.max_query_len, max_seq_len=ctx.max_seq_len)
    return K.attention_paged(q, k_cache, v_cache, ctx.block_table, ctx.query_start_loc, ctx.seq_lens,
                             scale, sliding_window=sw, **host)


def rope_cos_sin(ctx: ForwardContext, head_dim: int, base: float, scaling, max_position_embeddings):
    """(cos, sin) fp32 [T, head_dim // 2] of ``ctx.positions``.

    With the step's host bound (``ctx.max_seq_len``: positions < it) on device positions, the
    kernel gathers the rows from its table with no read back of the positions, so the step can be
    captured in a CUDA graph (the kernel keeps every table a graph may read). Same bits either
    way: rotary_cos_sin's row of a position depends only on the position.
    """
    K = _kernels()
    bound = None if ctx.max_seq_len is None or K.host_readable(ctx.positions) else ctx.max_seq_len
    return K.rotary_cos_sin(ctx.positions, head_dim, base, scaling, dtype=torch.float32,
                            max_position_embeddings=max_position_embeddings, max_seq_len=bound)


@dataclass
class LayerCall:
    """What a decoder layer needs besides its tensors (captured, so a checkpoint replay sees it)."""
    family: "DenseFamily"
    ctx: ForwardContext
    spec: DenseSpec
    layer_idx: int
    dtype: torch.dtype
    recorder: Recorder | None = None
    share: dense_tp.LayerShare | None = None  # a tensor-parallel rank's share of the layer; None: all of it


def decoder_layer(layer, h, residual, cos, sin, *, bm: LayerCall):
    """One decoder layer: returns (mlp_out, residual); the next norm adds them (fused)."""
    # the mode rides in the context, so a checkpointed layer recomputed in backward runs in it too
    with fp8_mode.projections(bm.ctx.quantization):
        return _decoder_layer(layer, h, residual, cos, sin, bm)


def _decoder_layer(layer, h, residual, cos, sin, bm: LayerCall):
    i, dt, rec = bm.layer_idx, bm.dtype, bm.recorder
    p = f"layers.{i}"
    if residual is None:
        residual = h
        x = rms_norm(layer.input_layernorm, h, dt)
    else:
        x, residual = fused_add_rms_norm(layer.input_layernorm, h, residual, dt)
    if rec is not None:
        rec(f"{p}.input_layernorm", (x, residual))
    share = bm.share
    a = attention(layer.self_attn, x, cos, sin, bm.ctx, bm.spec, i, dt, rec, f"{p}.self_attn",
                  share=None if share is None else share.attn)
    x, residual = fused_add_rms_norm(layer.post_attention_layernorm, a, residual, dt)
    if rec is not None:
        rec(f"{p}.post_attention_layernorm", (x, residual))
    m = bm.family.mlp(layer.mlp, x, dt, rec, f"{p}.mlp", fuse=bm.ctx.paged, share=None if share is None else share.mlp)
    return m, residual


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
