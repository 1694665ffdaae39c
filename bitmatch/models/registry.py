"""Model families: which bitmatch module runs which HF architecture, declared once.

Everything that knows an architecture lives in its family module; the engine, ``bitmatch.patch``,
``bitmatch.sync`` and the adapters (vLLM, TRL, verl) ask the registry and never name an
architecture themselves.

How to add a family (one module plus its tests):

1. Write ``bitmatch/models/<family>.py`` with a ``Family`` subclass and ``register(MyFamily())``
   at module level. ``model_types`` maps each HF ``config.model_type`` it serves to the HF
   architecture class name (``Qwen3MoeForCausalLM``), which is also the vLLM architecture.
2. Implement ``problems(config)`` (every unsupported option, all at once: each one a sentence
   naming the option and the value), ``build_spec(lm)`` (a frozen dataclass read from the config
   and modules), ``forward_hidden`` / ``compute_logits`` on ``bitmatch.kernels`` only,
   ``cache_groups(spec, dtype)`` (the engine allocates what they describe: ``"paged_kv"``,
   per-token ``"paged"`` state, per-sequence ``"per_seq"`` state; see ``CacheGroup``) and
   ``patch_modules(lm)`` (what ``bitmatch.patch`` rebinds).
3. Declare ``packed_modules``: how vLLM merges HF tensors (``qkv_proj`` = q, k, v rows) or
   renames them; ``bitmatch.sync`` and the vLLM plugin derive their name tables from it.
4. Declare its tiny shapes: ``tiny_config(name=None, **overrides)`` (and ``tiny_configs`` for
   named ones; ``tiny_model`` where random weights need more than HF's init). The conformance
   suite, ``bitmatch check/locate --family`` and the tests build their models from it.
5. Add the module to ``FAMILY_MODULES`` below. Tests: parity with HF's own fp32 forward,
   engine vs trainer Diff = 0 along every axis, a control that fails on HF's stock forward
   (``tests/test_family_conformance.py`` runs them for every registered family).

Users can also ``register`` a family from their own package before building a model.
"""
from __future__ import annotations

import importlib
import types
from dataclasses import dataclass
from functools import partial
from typing import Callable, Iterable

import torch

from bitmatch.models.state import create_state, drop_state, get_state

FAMILY_MODULES = ("bitmatch.models.dense", "bitmatch.models.qwen3_moe", "bitmatch.models.nemotron_h",
                 "bitmatch.models.deepseek_v4")

Recorder = Callable[[str, object], None]


@dataclass(frozen=True)
class CacheGroup:
    """One kind of engine state, for the layers that use it. The forward context carries
    ``ctx.caches[name][layer_idx]``.

    ``paged_kv``: K and V of ``num_kv_heads`` x ``head_dim`` per token, in the engine's paged
    blocks: per layer a (k_cache, v_cache) pair, each [num_blocks, block_size, Hkv, D].
    ``paged``: any per-token state in the same paged blocks (same ``slot_mapping`` /
    ``block_table`` as the K/V): per layer a tuple with one [num_blocks, block_size, *shape]
    tensor per ``tensors`` entry ``(shape, dtype)``. Prefix caching stays exact as long as a
    token's state depends only on the tokens up to it.
    ``per_seq``: per-sequence state (recurrent states, open-chunk buffers): per layer a tuple with
    one [num_seqs, *shape] tensor per ``tensors`` entry; ``ctx.state_slots[b]`` is the slot of the
    b-th scheduled sequence. The engine zero-fills a slot when a sequence starts (or restarts
    after preemption) at token 0, and refuses prefix caching (a reused prefix has no state).
    """
    name: str
    kind: str
    layers: tuple[int, ...]
    num_kv_heads: int = 0
    head_dim: int = 0
    dtype: torch.dtype = torch.float32
    tensors: tuple = ()  # ((shape, dtype), ...) for "paged" and "per_seq"

    KINDS = ("paged_kv", "paged", "per_seq")

    def __post_init__(self):
        if self.kind not in self.KINDS:
            raise NotImplementedError(f"cache group {self.name!r}: kind {self.kind!r} is not one of {self.KINDS}")
        if self.kind != "paged_kv" and not self.tensors:
            raise ValueError(f"cache group {self.name!r}: kind {self.kind!r} needs tensors=((shape, dtype), ...)")

    def entries(self) -> tuple:
        """((shape, dtype), ...) of one layer's tensors (per token or per sequence)."""
        if self.kind == "paged_kv":
            return (((self.num_kv_heads, self.head_dim), self.dtype),) * 2
        return tuple((tuple(shape), dt) for shape, dt in self.tensors)

    def _bytes(self) -> int:
        total = 0
        for shape, dt in self.entries():
            n = 1
            for d in shape:
                n *= int(d)
            total += n * torch.empty((), dtype=dt).element_size()
        return len(self.layers) * total

    def bytes_per_block(self, block_size: int) -> int:
        """Bytes one block of ``block_size`` tokens costs (0 for per-sequence state)."""
        return 0 if self.kind == "per_seq" else block_size * self._bytes()

    def bytes_per_seq(self) -> int:
        """Bytes one sequence slot costs (0 for paged state)."""
        return self._bytes() if self.kind == "per_seq" else 0


def allocate_caches(groups: Iterable[CacheGroup], num_blocks: int, block_size: int, device,
                    num_seqs: int = 0) -> dict:
    """``{group name: {layer: cache}}`` for ``num_blocks`` blocks and ``num_seqs`` sequence slots;
    zero-filled, because masked-out cache slots must hold finite values (attention multiplies
    them by an exact zero)."""
    out = {}
    for g in groups:
        if g.kind == "per_seq":
            if num_seqs < 1:
                raise ValueError(f"allocate_caches: cache group {g.name!r} holds per-sequence state: "
                                 f"pass num_seqs >= 1 (got {num_seqs})")
            lead = (num_seqs,)
        else:
            lead = (num_blocks, block_size)
        out[g.name] = {i: tuple(torch.zeros(lead + shape, dtype=dt, device=device) for shape, dt in g.entries())
                       for i in g.layers}
    return out


class Family:
    """The interface a family module implements (see the module docstring)."""
    name: str = ""
    model_types: dict[str, str] = {}
    # (engine module, HF modules in concatenation order) or (engine name, (HF name,)) for a rename
    packed_modules: tuple = ()
    # the bitmatch vLLM plugin runs this family (set once its vLLM path is built and tested)
    vllm_supported: bool = False
    # why not, when vllm_supported is False (the plugin's refusal quotes it)
    vllm_refusal: str = "its vLLM path is not built yet"
    # the ``quantization=`` modes its forward runs (bitmatch.models.fp8_mode); others are refused by name
    quantizations: tuple[str, ...] = ()

    def problems(self, config) -> list[str]:
        raise NotImplementedError

    def build_spec(self, lm):
        raise NotImplementedError

    def forward_hidden(self, lm, spec, input_ids, ctx, dtype, recorder: Recorder | None = None):
        raise NotImplementedError

    def compute_logits(self, lm, spec, hidden, dtype):
        raise NotImplementedError

    def cache_groups(self, spec, dtype) -> list[CacheGroup]:
        raise NotImplementedError

    def shard(self, lm, sharder):
        """One tensor-parallel rank's share of ``lm``, or None when the family declares no layout: the
        family says which module splits how (heads, columns, vocab rows, experts) and builds the
        pieces with ``sharder`` (``bitmatch.parallel.tensor_parallel.Sharder``: the mechanisms, so a
        family never imports ``bitmatch.parallel``). The share runs the family's own forward and has
        ``forward_hidden(input_ids, ctx, recorder)``, ``compute_logits(hidden)``, ``cache_groups()``,
        ``partial_parameters()``, ``moe_shards()``, ``tp`` and ``spec``; ``enable_tensor_parallel``
        sets it on the model. Default: None."""
        return None

    def cuda_graph_safe(self, lm) -> bool:
        """Whether the engine may capture this family's decode step in a CUDA graph: only a forward
        with no host sync and no data-dependent shapes opts in (dense and Qwen3-MoE do: its routing
        and grouped GEMM grid are sized by upper bounds on the device). Default False: the step
        runs eagerly."""
        return False

    def refresh_derived_weights(self, lm, force: bool = False) -> None:
        """Bring any weight the family derives from the parameters (fused copies, LoRA layers'
        merged weights) up to date in place; the engine calls it when it starts work and before a
        graph replay after weights may have changed (``force``: whatever the version counters
        say). Default: the family derives nothing."""

    # the family's named tiny shapes: name -> (HF model_type, overrides of its tiny config); the first
    # is the default. A family with one shape may leave it empty and only define tiny_config.
    tiny_configs: dict[str, tuple[str, dict]] = {}

    def tiny_config(self, name: str | None = None, **overrides):
        """An HF config of the family's tiny shape ``name`` (a ``tiny_configs`` entry or one of its
        model types; default: its first shape), ``overrides`` winning: the one source of the tiny
        models of the tests, ``bitmatch locate/check --family`` and the examples. Default: the
        family declares none (NotImplementedError)."""
        raise NotImplementedError(f"family {self.name!r} declares no tiny config: give a checkpoint path instead")

    def tiny_model(self, name: str | None = None, dtype: torch.dtype = torch.bfloat16, seed: int = 0,
                   attn_implementation: str = "eager", **overrides):
        """A random-weight model of ``tiny_config(name, **overrides)`` in ``dtype``, eval mode,
        deterministic given ``seed`` (drawn in fp32 under a forked RNG: the global RNG is untouched)."""
        import transformers  # a third-party import, deferred: building a model is the only use here

        cfg = self.tiny_config(name, **overrides)
        cfg._attn_implementation = attn_implementation
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
        return model.to(dtype).eval()

    def tiny_name(self, name: str | None) -> str:
        """``name`` checked against the family's tiny shapes and model types (None: the first shape,
        else the family's name); ValueError naming them otherwise."""
        if name is None:
            return next(iter(self.tiny_configs), self.name)
        if name in self.tiny_configs or name in self.model_types or name == self.name:
            return name
        raise ValueError(f"family {self.name!r} has no tiny config {name!r}: one of "
                         f"{sorted({*self.tiny_configs, *self.model_types})}")

    def patch_modules(self, lm) -> list[tuple[torch.nn.Module, Callable]]:
        """(module, forward(module, *args, state=PatchState, **kwargs)) pairs for ``bitmatch.patch``."""
        raise NotImplementedError

    def fp32_parameters(self, lm) -> set[str]:
        """HF names of the parameters this family's forward reads in float32 whatever the compute
        dtype (``cast_param(p, torch.float32)``, ``p.float()``: routers, SSM decay, mHC mixes). A
        rollout copy stores these in float32 and every other parameter in the compute dtype: a
        float32 master then reaches those reads unrounded, a bf16 master exactly. Default: none."""
        return set()

    @staticmethod
    def parameters_ending(lm, suffixes: tuple[str, ...]) -> set[str]:
        """Names of ``lm``'s parameters (tied ones under every name) ending in one of ``suffixes``."""
        return {n for n, _ in lm.named_parameters(remove_duplicate=False) if n.endswith(suffixes)}

    @property
    def architectures(self) -> tuple[str, ...]:
        return tuple(self.model_types.values())


_BY_MODEL_TYPE: dict[str, Family] = {}
_BY_ARCH: dict[str, Family] = {}
_loaded = False


def register(family: Family) -> Family:
    """Make ``family`` serve its ``model_types`` (a later registration of a type replaces it)."""
    for mt, arch in family.model_types.items():
        _BY_MODEL_TYPE[mt] = family
        _BY_ARCH[arch] = family
    return family


def _load() -> None:
    global _loaded
    if not _loaded:
        _loaded = True
        for mod in FAMILY_MODULES:
            importlib.import_module(mod)


def families() -> list[Family]:
    _load()
    seen: dict[int, Family] = {}
    for f in _BY_MODEL_TYPE.values():
        seen.setdefault(id(f), f)
    return list(seen.values())


def supported_architectures() -> dict[str, str]:
    """``{model_type: architecture}`` of every registered family."""
    _load()
    return {mt: f.model_types[mt] for mt, f in _BY_MODEL_TYPE.items()}


def supported_message() -> str:
    return ", ".join(f"{arch} (model_type {mt!r})" for mt, arch in supported_architectures().items())


def family_for_architecture(arch: str) -> Family:
    _load()
    if arch not in _BY_ARCH:
        raise ValueError(f"bitmatch: no model family serves architecture {arch!r}; supported: {supported_message()}")
    return _BY_ARCH[arch]


def find_family(arch: str) -> Family | None:
    """The family serving architecture ``arch``, or None."""
    _load()
    return _BY_ARCH.get(arch)


def family_for_config(config, arch: str | None = None) -> Family:
    """The family of an HF config; ValueError naming ``arch`` (default: the config's) and the
    supported architectures otherwise."""
    _load()
    mt = getattr(config, "model_type", None)
    if mt not in _BY_MODEL_TYPE:
        arch = arch or (getattr(config, "architectures", None) or [type(config).__name__])[0]
        raise ValueError(f"bitmatch: unsupported architecture {arch} (model_type {mt!r}); "
                         f"supported: {supported_message()}. To add a family: docs/porting.md in the bitmatch source")
    return _BY_MODEL_TYPE[mt]


def check_config(config, arch: str | None = None) -> Family:
    """The family, after checking that it reproduces every option of ``config``; ValueError
    listing every unsupported option at once otherwise."""
    fam = family_for_config(config, arch)
    probs = fam.problems(config)
    if probs:
        arch = fam.model_types[config.model_type]
        raise ValueError(f"bitmatch: {arch} with unsupported options: " + "; ".join(probs))
    return fam


def spec_of(lm):
    """(family, spec) of an unwrapped causal LM, read from its config and modules once per model
    object (kept in its ``ModelState``), not on every forward."""
    st = get_state(lm)
    if st is not None and st.spec is not None:
        return st.spec
    fam = check_config(getattr(lm, "config", None), type(lm).__name__)
    hit = (fam, fam.build_spec(lm))
    if hasattr(lm, "__dict__"):
        create_state(lm).spec = hit
    return hit


def forget_spec(lm) -> None:
    """Drop ``lm``'s cached spec (the next ``spec_of`` reads the config and modules again)."""
    drop_state(lm, "spec")


def tp_shard(lm):
    """This rank's tensor-parallel shard of ``lm`` (``bitmatch.parallel.enable_tensor_parallel``), or
    None when it runs as one process. A family's ``forward_hidden`` / ``compute_logits`` /
    ``cache_groups`` hand over to the shard's methods of the same names while one is set."""
    st = get_state(lm)
    return None if st is None else st.tp


def tp_step(lm):
    """How an engine steps ``lm``'s rank together with the other ranks of its layout, or None (each
    engine steps alone): ``step(engine)`` -> this rank's finished requests, or None once no rank has
    a request left. ``bitmatch.parallel.enable_expert_parallel`` sets it (data-parallel experts: every
    rank runs each MoE layer's collectives)."""
    st = get_state(lm)
    return None if st is None else st.tp_step


# ----------------------------------------------------------------------------- patch state

@dataclass(eq=False)
class PatchState:
    """What ``bitmatch.patch`` set on one causal LM: its family, compute dtype and quantization (read
    live by every bound forward, so patching again with another dtype updates them all)."""
    family: Family
    compute_dtype: torch.dtype | None
    quantization: str | None = None


class BoundForward:
    """A family forward bound to a module by ``bitmatch.patch``: ``fn(module, *args, state=...)``."""
    __slots__ = ("fn", "state", "saved")

    def __init__(self, fn, state: PatchState, saved):
        self.fn, self.state, self.saved = fn, state, saved

    def __call__(self, module, *args, **kwargs):
        return self.fn(module, *args, state=self.state, **kwargs)


def patch_state(lm) -> PatchState | None:
    """What ``bitmatch.patch`` set on ``lm``, or None when it is not patched."""
    st = get_state(lm)
    return None if st is None else st.patch


def bound_forward(mod) -> BoundForward | None:
    f = getattr(mod, "__dict__", {}).get("forward")
    return f.__func__ if isinstance(f, types.MethodType) and isinstance(f.__func__, BoundForward) else None


def compute_dtype_of(lm) -> torch.dtype:
    """The dtype weights are cast to at use: ``patch(compute_dtype=...)``, else the embedding's dtype."""
    st = patch_state(lm)
    if st is not None and st.compute_dtype is not None:
        return st.compute_dtype
    return lm.get_input_embeddings().weight.dtype  # not every family names it embed_tokens


def call_layer(layer, fn, args, bm):
    """Run ``fn(layer, *args, bm=bm)``: through the module's ``__call__`` when it is patched (HF
    gradient checkpointing, FSDP and forward hooks see it), else through HF's checkpoint function
    when the layer checkpoints, else directly."""
    if bound_forward(layer) is not None:
        return layer(*args, bm=bm)
    if getattr(layer, "gradient_checkpointing", False) and layer.training and torch.is_grad_enabled():
        return layer._gradient_checkpointing_func(partial(fn, layer, bm=bm), *args)
    return fn(layer, *args, bm=bm)
