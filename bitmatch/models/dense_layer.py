"""One decoder layer of the dense family: attention, the gated MLP and the layer that runs them.

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

Qwen3-MoE runs this layer with its own MLP (``family.mlp``); Nemotron-H shares ``paged_attention``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

import bitmatch.kernels as K
from bitmatch.context import ForwardContext
from bitmatch.models import dense_tp, fp8_mode
from bitmatch.models.fused_proj import fused_linear, fused_weight
from bitmatch.models.primitives import fused_add_rms_norm, linear, rms_norm
from bitmatch.models.registry import Recorder

if TYPE_CHECKING:  # annotations only: dense.py imports this module
    from bitmatch.models.dense import DenseFamily, DenseSpec


def gated_mlp(mlp_mod, x: torch.Tensor, dtype: torch.dtype, rec: Recorder | None = None, prefix: str = "mlp",
              fuse: bool = False, share=None):
    """``fuse``: gate/up as one GEMM on the fused copy (the engine's paged steps only: the engine
    rebuilds the copies whenever it starts work, so a weight written behind autograd's back, e.g.
    through ``param.data`` or by an optimizer, cannot leave a stale copy in a trainer forward).
    ``share``: a tensor-parallel rank's ``dense_tp.MlpShare`` (its intermediate columns, down_proj
    row-parallel): the same ops in the same order on the rank's columns."""
    f = fused_weight(mlp_mod, "gate_up", (mlp_mod.gate_proj, mlp_mod.up_proj), dtype) if fuse and not share else None
    if share is not None:
        x = share.enter(x)
        g, u, gu = share.gate(x), share.up(x), None
    elif f is not None:  # [g | u] as one GEMM: exactly the cat below, without the copy
        w, b, segs = f
        gu = K.linear(x, w, b, segments=segs)
        g, u = gu[:, :segs[0]], gu[:, segs[0]:]   # views for a recorder: the step runs what it runs unrecorded
    else:
        g = linear(mlp_mod.gate_proj, x, dtype)
        u = linear(mlp_mod.up_proj, x, dtype)
        gu = None
    if rec is not None:
        rec(f"{prefix}.gate_proj", g)
        rec(f"{prefix}.up_proj", u)
    a = K.silu_and_mul(torch.cat([g, u], dim=-1) if gu is None else gu)
    if rec is not None:
        rec(f"{prefix}.act_fn", a)
    y = linear(mlp_mod.down_proj, a, dtype) if share is None else share.down(a)
    if rec is not None:
        rec(f"{prefix}.down_proj", y)
    return y


def attention(attn, x, cos, sin, ctx: ForwardContext, spec: DenseSpec, layer_idx: int, dtype,
              rec: Recorder | None = None, prefix: str = "self_attn", share=None):
    """``share``: a tensor-parallel rank's ``dense_tp.AttentionShare`` (its heads; o_proj row-parallel)."""
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
