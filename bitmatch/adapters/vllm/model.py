"""vLLM model classes that run a registered bitmatch family on bitmatch kernels.

For every architecture the registry serves with ``vllm_supported``, ``Bitmatch<Arch>`` is built on
first use (module ``__getattr__``, so vLLM's lazy "module:Class" registry entries resolve in every
process) as ``BitmatchMixin`` + vLLM's own class: construction, ``load_weights`` and the
registry's interface checks stay vLLM's; ``forward`` and ``compute_logits`` are replaced.

The forward is the family's own ``forward_hidden`` (the very function the trainer runs), applied
to an HF-shaped skeleton of the model: the HF class built on the meta device from the HF config
vLLM loaded, whose every parameter is then replaced by a view of vLLM's parameter that holds it
(``bitmatch.sync.build_layout`` from the family's ``packed_modules``: fused ``qkv_proj`` /
``gate_up_proj`` rows, renamed expert tensors, the first ``vocab_size`` rows of a padded
vocabulary). A row block of the invariant linear's weight gives each output column exactly the
bits of the unmerged projection, and views see in-place weight updates at once. The model
config is the HF config vLLM loaded, so shapes, RoPE and windows come from the same place as on
the trainer side.

vLLM's ``Attention`` modules stay only so that vLLM sizes and allocates the paged KV cache and
builds the per-step metadata; each layer writes and reads its own plain layout inside its
``attn.kv_cache`` tensor (``kv_cache.py``) through ``kernels.write_kv_cache`` and
``kernels.attention_paged``.

Invariance: the hidden state and fp32 logits of every token equal, bit for bit, the ones
``bitmatch.token_logprobs`` computes on the HF model with the same weights, for any batch,
chunked-prefill split, decode step, block size or block table vLLM schedules.
"""
from __future__ import annotations

import importlib

import torch
from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod

from bitmatch.context import ForwardContext
from bitmatch.models import cache_groups, check_supported, compute_logits, family_for_config, forward_hidden, model_spec
from bitmatch.sync import build_layout

from .checks import BitmatchUnsupportedError, check_engine_config, vllm_architectures
from .kv_cache import check_backend, paged_kv_views


class PlainLinearMethod(UnquantizedLinearMethod):
    """Unquantized linear that keeps ``layer.weight`` the plain ``[out, in]`` Parameter.

    vLLM's CPU method repacks each weight for oneDNN after loading and leaves ``layer.weight``
    empty, without its ``weight_loader``: bitmatch's kernels could not read it, and a later
    per-parameter ``load_weights`` (TRL's and verl's weight sync) would update nothing.
    """

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        pass  # keep the loaded layout: bitmatch reads layer.weight directly

    def apply(self, layer, x, bias=None):
        raise RuntimeError("bitmatch: this linear layer's forward runs on bitmatch.kernels, not on vLLM's gemm")


_PLAIN_MOE: dict[type, type] = {}


def _plain_moe_method(method):
    """The experts' unquantized method, minus its post-load conversion: vLLM's CPU/GPU backends
    shuffle w13/w2 into a kernel format after loading; bitmatch reads them as [E, 2I, H] / [E, H, I]."""
    base = type(method)
    if base not in _PLAIN_MOE:
        def process_weights_after_loading(self, layer):
            pass  # keep the loaded layout

        def apply(self, *args, **kwargs):
            raise RuntimeError("bitmatch: these experts run on bitmatch.kernels.moe_experts, not on vLLM's fused MoE")

        _PLAIN_MOE[base] = type(f"Plain{base.__name__}", (base,), {
            "process_weights_after_loading": process_weights_after_loading, "apply": apply})
    method.__class__ = _PLAIN_MOE[base]


def keep_plain_linear_weights(model: torch.nn.Module) -> None:
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod

    for name, mod in model.named_modules():
        qm = getattr(mod, "quant_method", None)
        if hasattr(mod, "w13_weight") and qm is not None:
            if type(qm) is UnquantizedFusedMoEMethod:
                _plain_moe_method(qm)
            elif type(qm) not in _PLAIN_MOE.values():
                raise BitmatchUnsupportedError(f"bitmatch: experts {name} use {type(qm).__name__}; only unquantized "
                                               "experts are supported")
            continue
        if not isinstance(mod, LinearBase):
            continue
        if type(mod.quant_method) is UnquantizedLinearMethod:
            mod.quant_method = PlainLinearMethod()
        elif not isinstance(mod.quant_method, PlainLinearMethod):
            raise BitmatchUnsupportedError(
                f"bitmatch: linear layer {name} uses {type(mod.quant_method).__name__}; only unquantized "
                "weights are supported")


def hf_skeleton(hf_config, engine_params: dict[str, torch.Tensor]):
    """The HF causal LM of ``hf_config`` whose parameters are views of ``engine_params`` (vLLM's)."""
    import transformers

    arch = family_for_config(hf_config).model_types[hf_config.model_type]
    with torch.device("meta"):
        skel = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=next(iter(engine_params.values())).dtype)
    names = dict(skel.named_parameters())  # a tied lm_head appears once, as the embedding
    layout = build_layout(arch, {n: tuple(p.shape) for n, p in names.items()})
    for name, p in names.items():
        slot = layout.hf_to_engine[name]
        if slot.engine_name not in engine_params:
            raise BitmatchUnsupportedError(f"bitmatch: vLLM has no parameter {slot.engine_name!r} for HF {name!r}")
        src = engine_params[slot.engine_name]
        view = src.narrow(0, slot.row_start, slot.rows) if src.dim() else src
        if tuple(view.shape) != tuple(p.shape):
            raise BitmatchUnsupportedError(f"bitmatch: vLLM parameter {slot.engine_name!r} rows {slot.row_start}+"
                                           f"{slot.rows} have shape {tuple(view.shape)}, HF {name!r} has "
                                           f"{tuple(p.shape)} (tensor parallelism is not supported)")
        mod_name, _, attr = name.rpartition(".")
        setattr(skel.get_submodule(mod_name), attr, torch.nn.Parameter(view, requires_grad=False))
    if getattr(hf_config, "tie_word_embeddings", False):
        skel.lm_head.weight = skel.model.embed_tokens.weight
    skel.eval()
    return skel


def writable_slots(slot_mapping: torch.Tensor) -> torch.Tensor:
    """vLLM's slot mapping with its padding slots (PAD_SLOT_ID = -1: tokens that pad a CUDA graph's
    batch or a dummy run) sent to slot 0, which lies in vLLM's null block: the block pool hands
    block 0 to no request, so what a padding token writes there is never read."""
    slots = slot_mapping.long()
    return torch.where(slots < 0, torch.zeros_like(slots), slots)


def _host_int(md, name: str) -> int | None:
    value = getattr(md, name, None)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def attention_bounds(md, num_tokens: int, max_model_len: int, capturing: bool) -> tuple[int | None, int | None]:
    """(max_query_len, max_seq_len) for the attention launch. Eager: vLLM's host values of this
    step. While vLLM captures a FULL CUDA graph they are the dummy batch's (its contexts are a
    token long) and the graph is replayed for longer contexts: a launch sized by them would not
    cover a replayed step's KV. So a captured launch covers every context the model allows (the
    partitions past a row's context are empty: the same bits, kernels/triton/attention.py)."""
    if capturing:
        return min(num_tokens, max_model_len), max_model_len
    return _host_int(md, "max_query_len"), _host_int(md, "max_seq_len")


class BitmatchMixin:
    """Put first in the bases of a vLLM causal LM: replaces forward and compute_logits."""

    def __init__(self, *, vllm_config, prefix: str = ""):
        check_engine_config(vllm_config)  # again here: a worker may be started by other means
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        keep_plain_linear_weights(self)
        object.__setattr__(self, "_bitmatch_max_model_len", int(vllm_config.model_config.max_model_len))
        object.__setattr__(self, "_bitmatch_attns",
                           [m for m in self.modules() if hasattr(m, "kv_cache") and hasattr(m, "layer_name")])
        for attn in self._bitmatch_attns:
            check_backend(attn)
        # the skeleton lives outside the module tree (object.__setattr__): its parameters are views of
        # vLLM's and must not appear in named_parameters (weight loading and sync read those)
        object.__setattr__(self, "_bitmatch_skeleton", None)
        self.hf_view()  # refuse what the family or this plugin cannot run now, not at the first request
        object.__setattr__(self, "_bitmatch_skeleton", None)  # rebuilt after loading: vLLM may replace tensors

    def hf_view(self):
        """The model as ``bitmatch.models`` reads an HF causal LM (parameters are vLLM's own), built on
        first use, after vLLM has loaded the weights into the tensors it keeps."""
        if self._bitmatch_skeleton is None:
            skel = hf_skeleton(self.config, dict(self.named_parameters()))
            check_supported(skel)
            spec = model_spec(skel)
            windows = getattr(spec, "sliding_windows", ())
            if any(w is not None for w in windows):
                raise BitmatchUnsupportedError(
                    f"bitmatch: sliding-window attention (windows {windows}) under vLLM is not tested yet (vLLM "
                    "frees blocks outside the window); use a full-attention model")
            object.__setattr__(self, "_bitmatch_skeleton", skel)
        return self._bitmatch_skeleton

    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None, **kwargs):
        from vllm.forward_context import get_forward_context

        if inputs_embeds is not None or intermediate_tensors is not None:
            raise BitmatchUnsupportedError("bitmatch: inputs_embeds / pipeline-parallel inputs are not supported")
        all_md = get_forward_context().attn_metadata
        hidden = torch.zeros((input_ids.shape[0], self.config.hidden_size),
                             dtype=self.model.embed_tokens.weight.dtype, device=input_ids.device)
        if all_md is None:
            return hidden  # vLLM's dummy/profile run: no KV cache and no real tokens
        if isinstance(all_md, list):
            raise BitmatchUnsupportedError("bitmatch: micro-batched (DBO) forward is not supported")
        skel = self.hf_view()
        attns = self._bitmatch_attns
        md = all_md[attns[0].layer_name]
        if any(all_md[a.layer_name] is not md for a in attns[1:]):
            raise BitmatchUnsupportedError("bitmatch: layers with different KV cache groups are not supported")
        groups = cache_groups(skel)
        if [g.kind for g in groups] != ["paged_kv"] or len(groups[0].layers) != len(attns):
            raise BitmatchUnsupportedError(f"bitmatch: cache groups {[(g.name, g.kind) for g in groups]} are not "
                                           "supported under vLLM yet (one paged K/V cache per attention layer)")
        n = int(md.num_actual_tokens)
        nreq = md.seq_lens.shape[0]
        capturing = input_ids.is_cuda and torch.cuda.is_current_stream_capturing()
        max_query_len, max_seq_len = attention_bounds(md, n, self._bitmatch_max_model_len, capturing)
        ctx = ForwardContext(
            positions=positions[:n].long(), query_start_loc=md.query_start_loc[:nreq + 1],
            seq_lens=md.seq_lens, block_table=md.block_table[:nreq], slot_mapping=writable_slots(md.slot_mapping[:n]),
            caches={groups[0].name: {i: paged_kv_views(a) for i, a in zip(groups[0].layers, attns)}},
            # host-side bounds: without them each layer reads seq_lens back (a sync, and none is
            # allowed while vLLM captures a CUDA graph)
            max_query_len=max_query_len, max_seq_len=max_seq_len)
        hidden[:n] = forward_hidden(skel, input_ids[:n], ctx)
        return hidden

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """The family's head in the compute dtype, as the trainer's ``token_logprobs`` and the engine
        hand them to the logprob kernels (vLLM's sampler draws from an fp32 copy). Not cast here: on
        the GPU the logprob kernel's row sum is laid out by the width of its loads, so fp32 logits
        give other last bits of the log-sum-exp than the same values in bf16."""
        return compute_logits(self.hf_view(), hidden_states)


def class_name(arch: str) -> str:
    return f"Bitmatch{arch}"


def vllm_class(arch: str):
    """vLLM's own built-in class for ``arch`` (from its static table: the registry entry itself is
    replaced by the plugin)."""
    from vllm.model_executor.models.registry import _VLLM_MODELS

    if arch not in _VLLM_MODELS:
        raise BitmatchUnsupportedError(f"bitmatch: vLLM has no built-in model class for {arch!r}")
    mod, cls = _VLLM_MODELS[arch]
    return getattr(importlib.import_module(f"vllm.model_executor.models.{mod}"), cls)


_CLASSES: dict[str, type] = {}


def __getattr__(name: str):
    for arch in vllm_architectures():
        if name == class_name(arch):
            if arch not in _CLASSES:
                _CLASSES[arch] = type(name, (BitmatchMixin, vllm_class(arch)), {"__module__": __name__})
            return _CLASSES[arch]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
