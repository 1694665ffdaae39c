"""Tiny models and a character tokenizer built in code (no hub), shared by tests, demo, benchmarks.

``tiny_model(name_or_family, dtype=..., seed=...)`` builds a random-weight HF causal LM through the
registered family's ``Family.tiny_model`` (the families declare their tiny shapes;
``TINY_CONFIGS`` lists the named ones the test matrix covers: head_dim 64 and 128, GQA ratios
1/4/8, tied and untied embeddings, RoPE-scaled configs, sliding windows, MoE). ``CharTokenizer``
maps printable ASCII one character per token.
"""
from __future__ import annotations

import torch

from bitmatch.models import families, supported_architectures

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


def _family_with(name: str):
    """The registered family whose tiny shapes or model types include ``name``."""
    for fam in families():
        if name in fam.tiny_configs or name in fam.model_types or name == fam.name:
            return fam
    raise ValueError(f"tiny_config: {name!r} is no registered family's tiny config, model type or name; "
                     f"families: {sorted(f.name for f in families())}, tiny configs: {sorted(tiny_configs())}, "
                     f"model types: {sorted(supported_architectures())}")


def tiny_configs() -> dict[str, tuple[str, dict]]:
    """Every registered family's named tiny shapes: name -> (model_type, overrides)."""
    return {n: v for fam in families() for n, v in fam.tiny_configs.items()}


# the named tiny shapes of the registered families (``Family.tiny_configs``), in registry order
TINY_CONFIGS = tiny_configs()


def _shape(name: str):
    """(family, the name its ``tiny_config`` takes): a family's own name that is neither one of its
    tiny shapes nor a model type ("dense") means its first shape (None)."""
    fam = _family_with(name)
    return fam, (None if name == fam.name and name not in fam.tiny_configs and name not in fam.model_types
                 else name)


def tiny_config(name_or_family: str = "qwen3", **overrides):
    """``Family.tiny_config`` of the family that declares ``name_or_family`` (a tiny shape's name,
    a model type or a family's name: its first shape); ``overrides`` win."""
    fam, name = _shape(name_or_family)
    return fam.tiny_config(name, **overrides)


def tiny_model(name_or_family: str = "qwen3-hd64-gqa4-tied", dtype: torch.dtype = torch.bfloat16,
               seed: int = 0, attn_implementation: str = "eager", **overrides):
    """``Family.tiny_model``: a random-weight tiny causal LM (eval mode), deterministic given ``seed``;
    ``name_or_family`` as ``tiny_config`` takes it."""
    fam, name = _shape(name_or_family)
    return fam.tiny_model(name, dtype=dtype, seed=seed, attn_implementation=attn_implementation, **overrides)


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
