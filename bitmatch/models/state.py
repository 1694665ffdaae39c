"""The one holder of what bitmatch keeps on a model: a ``ModelState`` in the object's ``__dict__``.

Every piece of per-model state lives in one slot of it, read and written through ``get_state`` /
``create_state`` / ``drop_state`` (nothing else names the attribute):

- ``patch`` (on a causal LM): the ``PatchState`` ``bitmatch.patch`` set; ``unpatch`` drops it;
- ``lm`` (on a patched LM's base model): the causal LM whose forward the base model's runs;
  ``unpatch`` drops it;
- ``spec`` (on a causal LM): ``(family, spec)`` read from the config and modules once
  (``registry.spec_of``); ``forget_spec`` and ``unpatch`` drop it;
- ``derived`` (on a module whose weights a family derives copies from: dense's fused q/k/v and
  gate/up, a LoRA layer's kept merged weight): name -> copy. Kept by ``unpatch``: an engine's
  captured CUDA graphs read them, and a graph holds addresses, not references; they go with the
  module;
- ``weights`` (on a model a ``bitmatch.sync`` receiver manages): its ``WeightState``;
- ``tp`` (on a causal LM): this rank's tensor-parallel shard ``bitmatch.parallel.enable_tensor_parallel``
  set (the family's forward, logits and caches run through it); ``disable_tensor_parallel`` drops it;
- ``tp_step`` (on a causal LM whose layout's ranks must step together, ``enable_expert_parallel``):
  ``step(engine)``, the engine's step joined with the other ranks' (set by ``bitmatch.parallel``, so the
  engine never imports it); ``disable_tensor_parallel`` drops it.

In ``__dict__``, so ``nn.Module.__setattr__`` / ``__getattr__`` never see it. A copy
(``copy.deepcopy``, pickle) keeps ``patch`` and ``lm`` (a copy of a patched model is patched; its
base model maps to the copy's LM) and nothing else: caches are rebuilt for the copy's own tensors,
and a copy is no receiver's target. The rotary tables are the kernel's own
(``kernels.rotary_cos_sin(..., max_seq_len=)``), not kept here.
"""
from __future__ import annotations

_ATTR = "_bitmatch"


class ModelState:
    """bitmatch's state on one object (see the module docstring for who sets each slot)."""
    __slots__ = ("patch", "lm", "spec", "derived", "weights", "tp", "tp_step")
    _COPIED = ("patch", "lm")

    def __init__(self):
        self.patch = None
        self.lm = None
        self.spec = None
        self.derived: dict = {}
        self.weights = None
        self.tp = None
        self.tp_step = None

    def __getstate__(self):
        return {k: getattr(self, k) for k in self._COPIED}

    def __setstate__(self, d):
        self.__init__()
        for k, v in d.items():
            setattr(self, k, v)

    def empty(self) -> bool:
        unset = all(getattr(self, k) is None for k in ("patch", "lm", "spec", "weights", "tp", "tp_step"))
        return unset and not self.derived


def get_state(obj) -> ModelState | None:
    """``obj``'s state, or None when bitmatch keeps nothing on it."""
    return getattr(obj, "__dict__", {}).get(_ATTR)


def create_state(obj) -> ModelState:
    """``obj``'s state, created empty on first use (AttributeError for an object without ``__dict__``)."""
    d = obj.__dict__
    st = d.get(_ATTR)
    if st is None:
        st = d[_ATTR] = ModelState()
    return st


def drop_state(obj, *slots: str) -> None:
    """Forget ``slots`` of ``obj``'s state (every slot when none is named); the holder goes once empty."""
    st = get_state(obj)
    if st is None:
        return
    for k in slots or ModelState.__slots__:
        setattr(st, k, {} if k == "derived" else None)
    if st.empty():
        del obj.__dict__[_ATTR]
