"""bitmatch.models.state: the one holder of per-model state, dropped by unpatch, not carried by a copy."""
import copy
import pickle

import torch

from bitmatch.models import dense, spec_of
from bitmatch.models.state import ModelState, create_state, drop_state, get_state
from bitmatch.patching import is_patched, patch, unpatch
from bitmatch.sync import WeightState, weight_state
from bitmatch.sync.receiver import attach_state
from bitmatch.testing.models import tiny_model


def _holders(m):
    return [name for name, mod in m.named_modules() if get_state(mod) is not None]


def test_patch_state_lives_in_one_holder_and_unpatch_drops_it():
    m = tiny_model("qwen3", seed=0)
    assert _holders(m) == []
    spec_of(m)
    patch(m)
    st = get_state(m)
    assert isinstance(st, ModelState) and st.patch is not None and st.spec is not None
    assert get_state(m.model).lm is m
    assert sorted(_holders(m)) == ["", "model"]
    assert not [k for mod in m.modules() for k in vars(mod) if k.startswith("_bitmatch") and k != "_bitmatch"]
    unpatch(m)
    assert not is_patched(m) and _holders(m) == []


def test_a_copy_keeps_the_patch_and_drops_caches_and_the_weight_state():
    m = patch(tiny_model("qwen3", seed=0))
    attach_state(m, WeightState())
    create_state(m.model.layers[0].mlp).derived["probe"] = torch.ones(2)
    c = copy.deepcopy(m)
    assert is_patched(c) and get_state(c.model).lm is c
    assert get_state(c).spec is None and weight_state(c) is None
    assert dense.fused_copies(c.model.layers[0].mlp) == {}
    ids = torch.tensor([[3, 5, 7]])
    with torch.no_grad():
        assert torch.equal(c(ids).logits, m(ids).logits)
    assert weight_state(m) is not None
    # a managed model pickles (the WeightState's lock stays behind)
    plain = unpatch(tiny_model("qwen3", seed=0))
    attach_state(plain, WeightState())
    assert weight_state(pickle.loads(pickle.dumps(plain))) is None


def test_drop_state_removes_the_holder_once_empty():
    m = torch.nn.Linear(2, 2)
    create_state(m).spec = ("f", "s")
    create_state(m).weights = WeightState()
    drop_state(m, "spec")
    assert get_state(m).spec is None and get_state(m).weights is not None
    drop_state(m)
    assert get_state(m) is None and "_bitmatch" not in vars(m)
