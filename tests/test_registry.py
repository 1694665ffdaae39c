"""The family registry's lookups that tools build on: every family gives a tiny config of its own
model type (``bitmatch locate/check --family``), and the compute dtype is read from the input
embedding whatever the family calls it."""
from __future__ import annotations

import pytest
import torch

from bitmatch.models import registry


@pytest.mark.parametrize("fam", registry.families(), ids=lambda f: f.name)
def test_every_family_has_a_tiny_config_of_its_own_type(fam):
    cfg = fam.tiny_config()
    assert cfg.model_type in fam.model_types
    assert registry.family_for_config(cfg) is fam
    assert fam.problems(cfg) == []


def test_find_family_and_unknown_architecture():
    assert registry.find_family("Qwen3ForCausalLM").name == "dense"
    assert registry.find_family("NoSuchForCausalLM") is None
    with pytest.raises(ValueError, match="NoSuchForCausalLM.*supported"):
        registry.family_for_architecture("NoSuchForCausalLM")


def test_compute_dtype_reads_the_input_embedding():
    class Renamed(torch.nn.Module):  # embedding not called model.embed_tokens
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(4, 2, dtype=torch.bfloat16)

        def get_input_embeddings(self):
            return self.emb

    assert registry.compute_dtype_of(Renamed()) == torch.bfloat16
