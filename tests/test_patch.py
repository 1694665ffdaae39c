"""bitmatch.patch / unpatch: in-place rebinding, parameters kept, clear errors."""
import copy

import pytest
import torch

from bitmatch.models import cache_groups, check_supported, forward_hidden, pack, unwrap_causal_lm
from bitmatch.patching import BitmatchCacheError, is_patched, patch, unpatch
from bitmatch.testing.models import pad_batch, random_prompts, tiny_model


@pytest.fixture(scope="module")
def model():
    return tiny_model("qwen2-hd64-gqa1-bias-sw", dtype=torch.bfloat16, seed=0)


@torch.no_grad()
def test_patch_keeps_parameters_and_unpatch_restores(model):
    m = copy.deepcopy(model)
    ids, mask = pad_batch(random_prompts(3, 4, 12, seed=1), "right")
    before = m(input_ids=ids, attention_mask=mask).logits
    params = {n: p for n, p in m.named_parameters()}
    ptrs = {n: p.data_ptr() for n, p in params.items()}
    assert patch(m) is m and is_patched(m)
    assert {n: p for n, p in m.named_parameters()} == params
    assert all(p.data_ptr() == ptrs[n] for n, p in m.named_parameters())
    assert all(p.requires_grad for p in m.parameters())
    patched = m(input_ids=ids, attention_mask=mask).logits
    assert not torch.equal(patched, before)  # other kernels
    patch(m)  # idempotent
    assert unpatch(m) is m and not is_patched(m)
    assert all("forward" not in mod.__dict__ for mod in m.modules())
    assert torch.equal(m(input_ids=ids, attention_mask=mask).logits, before)


@torch.no_grad()
def test_patched_forward_refuses_kv_cache(model):
    m = copy.deepcopy(model)
    patch(m)
    ids = torch.tensor([[5, 6, 7]])
    with pytest.raises(BitmatchCacheError, match="bitmatch.Engine"):
        m(ids, use_cache=True)
    with pytest.raises(BitmatchCacheError, match="bitmatch.Engine"):
        m.generate(ids, max_new_tokens=2, do_sample=False)
    with pytest.raises(ValueError, match="inputs_embeds"):
        m(inputs_embeds=torch.zeros(1, 3, m.config.hidden_size, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="inside bitmatch"):
        m.model.layers[0](torch.zeros(3, m.config.hidden_size, dtype=torch.bfloat16))
    # the base model's forward is patched too: hidden states at real tokens, zeros at padding
    ids, mask = pad_batch([[5, 6, 7], [8, 9]], "left")
    h = m.model(input_ids=ids, attention_mask=mask).last_hidden_state
    p = pack(ids, mask)
    ref = forward_hidden(m, p.input_ids, p.context())
    assert torch.equal(h[mask.bool()], ref) and (h[~mask.bool()] == 0).all()
    unpatch(m)


def test_unsupported_architecture_error():
    from transformers import GPT2Config, GPT2LMHeadModel

    g = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=32))
    for fn in (patch, check_supported):
        with pytest.raises(ValueError) as e:
            fn(g)
        msg = str(e.value)
        for arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "LlamaForCausalLM", "MistralForCausalLM",
                     "GPT2LMHeadModel"):
            assert arch in msg


class _DDPLike(torch.nn.Module):
    def __init__(self, m):
        super().__init__()
        self.module = m


class _PeftLike(torch.nn.Module):
    def __init__(self, m):
        super().__init__()
        self.base_model = torch.nn.Module()
        self.base_model.model = m


def test_wrapped_models_are_unwrapped(model):
    m = copy.deepcopy(model)
    for w in (_DDPLike(m), _PeftLike(m), _DDPLike(_PeftLike(m))):
        assert unwrap_causal_lm(w) is m
        patch(w)
        assert is_patched(m)
        unpatch(w)
        assert not is_patched(m)
    [g] = cache_groups(_DDPLike(m))
    assert (g.kind, g.layers, g.num_kv_heads, g.head_dim, g.dtype) == ("paged_kv", (0, 1), 2, 64, torch.bfloat16)


def test_compute_dtype_validation(model):
    m = copy.deepcopy(model)
    with pytest.raises(ValueError, match="compute_dtype"):
        patch(m, compute_dtype=torch.float16)


@torch.no_grad()
def test_padding_free_packing_with_position_ids(model):
    """One row holding two sequences, positions restarting at 0 (TRL-style padding-free
    batches): the logits equal those of the sequences in separate rows, bitwise."""
    m = copy.deepcopy(model)
    patch(m)
    a, b = random_prompts(2, 5, 11, seed=8)
    row = torch.tensor([a + b])
    pos = torch.tensor([list(range(len(a))) + list(range(len(b)))])
    packed = m(input_ids=row, position_ids=pos).logits[0]
    ids, mask = pad_batch([a, b], "right")
    sep = m(input_ids=ids, attention_mask=mask).logits
    assert torch.equal(packed[:len(a)], sep[0, :len(a)]) and torch.equal(packed[len(a):], sep[1, :len(b)])
    # standalone patched submodules run on the kernels too
    x = torch.randn(4, m.config.hidden_size).to(torch.bfloat16)
    from bitmatch.models import dense

    assert torch.equal(m.model.layers[0].mlp(x), dense.gated_mlp(m.model.layers[0].mlp, x, torch.bfloat16))
    assert torch.equal(m.model.norm(x), dense.rms_norm(m.model.norm, x, torch.bfloat16))
    unpatch(m)
