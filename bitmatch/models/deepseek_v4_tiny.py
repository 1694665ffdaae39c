"""A tiny random DeepSeek-V4 built in code (no hub): the shape behind ``DeepseekV4Family.tiny_config``
and ``tiny_model`` (tests, ``bitmatch check --family``, the GRPO example, benchmarks).

Every feature is on: the three attention types (sliding, CSA with the Lightning Indexer, HCA),
small compress rates so a 40-token sequence spans several HCA windows, an indexer top-k smaller
than the number of entries, hash routing on layer 0 and learned routing after, mHC with 2 streams,
YaRN on the compressed layers, grouped output projection. The parameters HF initialises to
constants (sinks, position biases, mHC bases, the hash table, the correction bias) are drawn at
random, so none of them is a no-op in a test.
"""
from __future__ import annotations

import torch

LAYER_TYPES = ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
               "compressed_sparse_attention"]


def tiny_config(**overrides):
    """DeepseekV4Config: hidden 64, 4 layers (sliding, CSA, HCA, CSA), CSA rate 2, HCA rate 4."""
    from transformers import DeepseekV4Config

    kw = dict(vocab_size=128, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=4,
              num_attention_heads=4, head_dim=32, q_lora_rank=32, partial_rotary_factor=0.5,
              num_experts_per_tok=2, n_routed_experts=4, layer_types=list(LAYER_TYPES),
              compress_rates={"compressed_sparse_attention": 2, "heavily_compressed_attention": 4},
              sliding_window=6, mlp_layer_types=["hash_moe", "moe", "moe", "moe"], hc_mult=2, hc_sinkhorn_iters=6,
              o_groups=2, o_lora_rank=16, index_n_heads=8, index_head_dim=16, index_topk=3,
              max_position_embeddings=512, initializer_range=0.1, swiglu_limit=1.0,
              rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128},
              pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    kw.update(overrides)
    return DeepseekV4Config(**kw)


def tiny_model(dtype=torch.float32, seed: int = 0, **overrides):
    """A random-weight DeepseekV4ForCausalLM of ``tiny_config(**overrides)`` in ``dtype``."""
    from transformers import DeepseekV4ForCausalLM

    cfg = tiny_config(**overrides)
    torch.manual_seed(seed)
    model = DeepseekV4ForCausalLM(cfg)
    randomize_constants(model, seed + 1)
    model.config._experts_implementation = "eager"
    return model.to(dtype).eval()


def randomize_constants(model, seed: int = 1) -> None:
    """Draw the parameters HF initialises to constants (sinks, position biases, mHC bases and
    scales, the hash table, the router correction bias), on the model's own device."""
    g = torch.Generator().manual_seed(seed)

    def rnd(t, std, mean=0.0):
        return (mean + std * torch.randn(t.shape, generator=g)).to(t.device, t.dtype)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("sinks"):
                p.copy_(rnd(p, 1.0))
            elif name.endswith("position_bias"):
                p.copy_(rnd(p, 0.5))
            elif name.endswith(("attn_hc.base", "ffn_hc.base", "hc_base")):
                p.copy_(rnd(p, 0.3))
            elif name.endswith(("attn_hc.scale", "ffn_hc.scale", "hc_scale")):
                p.copy_(rnd(p, 0.2, 1.0))
        for name, b in model.named_buffers():
            if name.endswith("tid2eid"):
                e = model.config.n_routed_experts
                perm = torch.rand(b.shape[0], e, generator=g).argsort(-1)[:, : b.shape[1]]  # distinct experts
                b.copy_(perm.to(b.device))
            elif name.endswith("e_score_correction_bias"):
                b.copy_(rnd(b, 0.1))
