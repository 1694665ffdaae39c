"""Shared pieces of the bitmatch.sync tests: a tiny Qwen3 and a fake vLLM model.

The fake mimics vLLM's dense ``load_weights``: merged qkv_proj / gate_up_proj parameters and a
stacked_params_mapping with shard offsets computed from the config, written independently of
bitmatch.sync.names so the two check each other.
"""
from __future__ import annotations

import torch

from bitmatch.precision import compute_cast


def two_tensor_state(seed: int, n: int = 200_000, cols: int = 100):
    """fp32 master weights: a flat tensor of n and an [n // cols, cols] one."""
    g = torch.Generator().manual_seed(seed)
    return {"a.weight": torch.randn(n, generator=g), "b.weight": torch.randn(n // cols, cols, generator=g)}


def bf16_target(state):
    """A zeroed bf16 rollout dict with the shapes of ``state``."""
    return {k: torch.zeros(v.shape, dtype=torch.bfloat16) for k, v in state.items()}


def bits_equal(live, master):
    """Every live bf16 tensor holds exactly compute_cast(master) (bit for bit)."""
    return all(torch.equal(live[k].view(torch.int16), compute_cast(v, torch.bfloat16).view(torch.int16))
               for k, v in master.items())


def tiny_qwen3(seed: int = 0, dtype=torch.float32, tie: bool = False):
    from transformers import Qwen3Config, Qwen3ForCausalLM
    cfg = Qwen3Config(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      tie_word_embeddings=tie, architectures=["Qwen3ForCausalLM"])
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        m = Qwen3ForCausalLM(cfg)
    return m.to(dtype).eval()


class FakeVllmQwen3(torch.nn.Module):
    """Parameter holder in vLLM's layout with a vLLM-style load_weights."""

    def __init__(self, hf_model, dtype=torch.bfloat16):
        super().__init__()
        self.config = hf_model.config
        c = self.config
        self.q_size = c.num_attention_heads * c.head_dim
        self.kv_size = c.num_key_value_heads * c.head_dim
        self.inter = c.intermediate_size
        self.holder = {}
        for name, p in hf_model.named_parameters():
            for merged, part, _ in self.stacked():
                if f".{part}." in name:
                    name = name.replace(part, merged)
                    rows = self.q_size + 2 * self.kv_size if merged == "qkv_proj" else 2 * self.inter
                    shape = (rows, *p.shape[1:])
                    break
            else:
                shape = tuple(p.shape)
            self.holder[name] = torch.nn.Parameter(torch.zeros(shape, dtype=dtype), requires_grad=False)
        self.params = torch.nn.ParameterDict({k.replace(".", "__"): v for k, v in self.holder.items()})
        self.loads = 0

    @staticmethod
    def stacked():
        return [("qkv_proj", "q_proj", "q"), ("qkv_proj", "k_proj", "k"), ("qkv_proj", "v_proj", "v"),
                ("gate_up_proj", "gate_proj", 0), ("gate_up_proj", "up_proj", 1)]

    def named_parameters(self, *a, **k):
        return iter(self.holder.items())

    def _offset(self, shard):
        return {"q": 0, "k": self.q_size, "v": self.q_size + self.kv_size, 0: 0, 1: self.inter}[shard]

    def load_weights(self, weights):
        self.loads += 1
        for name, w in weights:
            for merged, part, shard in self.stacked():
                if f".{part}." in name:
                    p = self.holder[name.replace(part, merged)]
                    off = self._offset(shard)
                    p.data[off:off + w.shape[0]].copy_(w)
                    break
            else:
                self.holder[name].data.copy_(w)
        return set()
