"""Tiny models and a character tokenizer built in code (no hub), shared by tests, demo, benchmarks.

``tiny_model(name_or_family, dtype=..., seed=...)`` builds a random-weight HF causal LM of one of
the supported dense families; ``TINY_CONFIGS`` names the configurations the test matrix covers
(head_dim 64 and 128, GQA ratios 1/4/8, tied and untied embeddings, RoPE-scaled configs,
sliding windows). ``CharTokenizer`` maps printable ASCII one character per token.
"""
from __future__ import annotations

import torch

PAD, BOS, EOS = 0, 1, 2
_SPECIALS = ["<pad>", "<bos>", "<eos>"]
_CHARS = ["\n"] + [chr(c) for c in range(32, 127)]


class CharTokenizer:
    """One token per character: ids 0..2 are <pad>, <bos>, <eos>; then '\\n' and printable ASCII.

    Characters outside that set map to '?'. ``vocab_size`` is 128 (ids >= 99 are unused, so a
    model's vocabulary may be padded as real ones are).
    """

    pad_token_id = PAD
    bos_token_id = BOS
    eos_token_id = EOS
    pad_token = "<pad>"
    bos_token = "<bos>"
    eos_token = "<eos>"
    vocab_size = 128
    padding_side = "left"

    def __init__(self):
        self._id = {ch: i + len(_SPECIALS) for i, ch in enumerate(_CHARS)}
        self._tok = {i: ch for ch, i in self._id.items()}

    def __len__(self) -> int:
        return self.vocab_size

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = [self._id.get(ch, self._id["?"]) for ch in text]
        return ([BOS] + ids) if add_special_tokens else ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        if isinstance(ids, torch.Tensor):
            ids = ids.tolist()
        out = []
        for i in ids:
            i = int(i)
            if i < len(_SPECIALS):
                if not skip_special_tokens:
                    out.append(_SPECIALS[i])
            else:
                out.append(self._tok.get(i, ""))
        return "".join(out)

    def batch_decode(self, batch, skip_special_tokens: bool = True) -> list[str]:
        return [self.decode(ids, skip_special_tokens) for ids in batch]

    def __call__(self, text, add_special_tokens: bool = True):
        if isinstance(text, str):
            return {"input_ids": self.encode(text, add_special_tokens)}
        return {"input_ids": [self.encode(t, add_special_tokens) for t in text]}


# name -> (family, overrides). Keep them tiny: the CPU reference kernels are slow.
TINY_CONFIGS: dict[str, tuple[str, dict]] = {
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
                                                  rope_parameters={"rope_type": "linear", "rope_theta": 1000000.0,
                                                                   "factor": 4.0})),
    # Qwen3-MoE: 8 experts top-2 renormalized, layer 1 dense (mlp_only_layers), head_dim 64, GQA 2
    "qwen3moe-e8-k2": ("qwen3_moe", dict(num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                                         head_dim=64, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
                                         norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[1])),
    # Qwen3-MoE: 4 experts top-1, not renormalized, every other layer sparse, tied embeddings
    "qwen3moe-e4-k1-step2": ("qwen3_moe", dict(num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                                               head_dim=64, num_experts=4, num_experts_per_tok=1,
                                               moe_intermediate_size=96, norm_topk_prob=False,
                                               decoder_sparse_step=2, tie_word_embeddings=True)),
}

FAMILIES = ("qwen2", "qwen3", "llama", "mistral", "qwen3_moe")


def tiny_config(family: str = "qwen3", **overrides):
    """A tiny HF config of ``family`` (qwen2, qwen3, llama, mistral); ``overrides`` win."""
    import transformers

    classes = {"qwen2": "Qwen2Config", "qwen3": "Qwen3Config", "llama": "LlamaConfig",
               "mistral": "MistralConfig", "qwen3_moe": "Qwen3MoeConfig"}
    if family in TINY_CONFIGS:
        family, extra = TINY_CONFIGS[family]
        overrides = {**extra, **overrides}
    if family not in classes:
        raise ValueError(f"tiny_config: family must be one of {sorted(classes)} or {sorted(TINY_CONFIGS)}, "
                         f"got {family!r}")
    kw = dict(vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=1024,
              rms_norm_eps=1e-6, tie_word_embeddings=False, initializer_range=0.1,
              pad_token_id=PAD, bos_token_id=BOS, eos_token_id=EOS)
    if family == "mistral":
        kw["sliding_window"] = None
    kw.update(overrides)
    rope = kw.pop("rope_parameters", None)
    cfg_cls = getattr(transformers, classes[family])
    if rope is not None:
        try:
            cfg = cfg_cls(rope_parameters=rope, **kw)
        except TypeError:  # older transformers: rope_scaling + rope_theta
            rope = dict(rope)
            theta = rope.pop("rope_theta", 10000.0)
            cfg = cfg_cls(rope_scaling=rope, rope_theta=theta, **kw)
    else:
        cfg = cfg_cls(**kw)
    return cfg


def tiny_model(name_or_family: str = "qwen3-hd64-gqa4-tied", dtype: torch.dtype = torch.bfloat16,
               seed: int = 0, attn_implementation: str = "eager", **overrides):
    """Random-weight tiny causal LM (eval mode). Deterministic given ``seed``."""
    import transformers

    cfg = tiny_config(name_or_family, **overrides)
    cfg._attn_implementation = attn_implementation
    g = torch.random.fork_rng()
    with g:
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model = model.to(dtype)
    model.eval()
    return model


def random_prompts(n: int, min_len: int = 1, max_len: int = 32, seed: int = 0, vocab_lo: int = 3,
                   vocab_hi: int = 99) -> list[list[int]]:
    """``n`` random token-id prompts with lengths in [min_len, max_len] (ids in [vocab_lo, vocab_hi))."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        L = int(torch.randint(min_len, max_len + 1, (1,), generator=g))
        out.append(torch.randint(vocab_lo, vocab_hi, (L,), generator=g).tolist())
    return out


def pad_batch(seqs: list[list[int]], side: str = "right", pad_id: int = PAD, length: int | None = None):
    """(input_ids [B, L] int64, attention_mask [B, L] int64) with ``side`` padding."""
    if side not in ("left", "right"):
        raise ValueError(f"pad_batch: side must be 'left' or 'right', got {side!r}")
    L = max(len(s) for s in seqs) if length is None else length
    ids = torch.full((len(seqs), L), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), L), dtype=torch.long)
    for i, s in enumerate(seqs):
        if side == "right":
            ids[i, :len(s)] = torch.tensor(s, dtype=torch.long)
            mask[i, :len(s)] = 1
        else:
            ids[i, L - len(s):] = torch.tensor(s, dtype=torch.long)
            mask[i, L - len(s):] = 1
    return ids, mask
