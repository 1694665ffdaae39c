"""bitmatch.patch / unpatch (module bitmatch.patching: a module named bitmatch.patch would shadow the
function bitmatch.patch once imported): run an HF causal LM's forward on bitmatch kernels in place.

The parameters stay the module's own; only ``forward`` of the causal LM, its base model and the
modules the model's family names (``Family.patch_modules``: decoder layers, attention, MLP / MoE
blocks, norms) is rebound (instance attributes; ``unpatch`` removes them). A patched
``model(input_ids, attention_mask)`` packs the real tokens, takes positions from the mask, and
returns logits computed by ``bitmatch.models.forward_hidden`` + ``compute_logits`` (zeros at
padding). There is no KV-cache path: generation goes through ``bitmatch.Engine``.
"""
from __future__ import annotations

import types

import torch

from bitmatch.models import compute_logits, forward_hidden, pack, spec_of, unwrap_causal_lm
from bitmatch.models.fp8_mode import check_model, check_quantization
from bitmatch.models.registry import BoundForward, PatchState, bound_forward, patch_state
from bitmatch.models.state import create_state, drop_state, get_state
from bitmatch.precision import SUPPORTED_COMPUTE_DTYPES, unsupported_dtype_message


class BitmatchCacheError(RuntimeError):
    pass


def _no_cache(what):
    raise BitmatchCacheError(
        f"bitmatch: a patched model has no KV-cache path ({what} was requested). Generate with "
        "bitmatch.Engine(model).generate(...) (same kernels, paged KV cache), or call the model "
        "without past_key_values/use_cache (full recompute)."
    )


def _patched_run(lm, input_ids, attention_mask, position_ids, past_key_values, inputs_embeds, use_cache):
    if past_key_values is not None:
        _no_cache("past_key_values")
    if use_cache:
        _no_cache("use_cache=True")
    if inputs_embeds is not None:
        raise ValueError("bitmatch: inputs_embeds is not supported by a patched model; pass input_ids")
    if input_ids is None:
        raise ValueError("bitmatch: input_ids is required")
    if isinstance(attention_mask, dict) or (attention_mask is not None and attention_mask.dim() != 2):
        raise ValueError("bitmatch: attention_mask must be the 2-D [batch, length] padding mask")
    if input_ids.dim() == 1:
        input_ids = input_ids[None]
    p = pack(input_ids, attention_mask, position_ids)
    return p, forward_hidden(lm, p.input_ids, p.context())   # in the patch's quantization


def _causal_forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                    inputs_embeds=None, labels=None, use_cache=None, logits_to_keep=0, *, state, **kwargs):
    from transformers.modeling_outputs import CausalLMOutputWithPast

    p, hidden = _patched_run(self, input_ids, attention_mask, position_ids, past_key_values, inputs_embeds,
                             use_cache)
    B, L = (input_ids[None] if input_ids.dim() == 1 else input_ids).shape
    cols = torch.arange(L, device=hidden.device)
    if isinstance(logits_to_keep, int):
        keep_cols = cols[-logits_to_keep:] if logits_to_keep > 0 else cols
    else:
        keep_cols = cols[logits_to_keep]
    keep = torch.zeros(L, dtype=torch.bool, device=hidden.device)
    keep[keep_cols] = True
    sel = keep[p.cols].nonzero(as_tuple=True)[0]
    logits_rows = compute_logits(self, hidden[sel])
    col_index = torch.full((L,), -1, dtype=torch.long, device=hidden.device)
    col_index[keep_cols] = torch.arange(keep_cols.numel(), device=hidden.device)
    logits = logits_rows.new_zeros((B, keep_cols.numel(), logits_rows.shape[-1]))
    logits = logits.index_put((p.rows[sel], col_index[p.cols[sel]]), logits_rows)
    loss = None
    if labels is not None:
        loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
    return CausalLMOutputWithPast(loss=loss, logits=logits)


def _base_forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                  inputs_embeds=None, use_cache=None, *, state, **kwargs):
    from transformers.modeling_outputs import BaseModelOutputWithPast

    lm = get_state(self).lm
    p, hidden = _patched_run(lm, input_ids, attention_mask, position_ids, past_key_values, inputs_embeds,
                             use_cache)
    B, L = (input_ids[None] if input_ids.dim() == 1 else input_ids).shape
    out = hidden.new_zeros((B, L, hidden.shape[-1])).index_put((p.rows, p.cols), hidden)
    return BaseModelOutputWithPast(last_hidden_state=out)


def _bind(mod, fn, state: PatchState):
    bf = bound_forward(mod)
    if bf is not None:
        bf.state = state  # patched again: the same binding, the new state
        return
    mod.forward = types.MethodType(BoundForward(fn, state, mod.__dict__.get("forward")), mod)


def unsupported_param_dtypes(lm) -> list[str]:
    """The floating dtypes among ``lm``'s parameters that bitmatch cannot compute in (not bf16 or
    fp32), sorted; empty when every parameter is computable as it is."""
    return sorted({str(p.dtype) for p in lm.parameters()
                   if p.is_floating_point() and p.dtype not in SUPPORTED_COMPUTE_DTYPES})


def patch(model, compute_dtype: torch.dtype | None = None, quantization: str | None = None):
    """Rebind ``model``'s forwards onto bitmatch kernels (in place); returns ``model``.

    ``model`` may be wrapped (DDP, FSDP, PEFT, torch.compile): the causal LM inside is found.
    ``compute_dtype``: cast each weight to this dtype at use (e.g. fp32 master weights with
    bf16 compute, through ``bitmatch.precision.compute_cast``); default: the parameters' dtype.
    ``quantization``: None, or "fp8" (the projections on block-FP8 weights, docs/fp8.md): the default
    of ``token_logprobs`` and of an ``Engine`` over this model, and the patched forward's mode.
    Raises ValueError for an unsupported architecture or option (all of them named at once).
    Invariance: the patched forward computes each token exactly as the engine does.
    """
    lm = unwrap_causal_lm(model)
    fam, _ = spec_of(lm)
    if compute_dtype is not None and compute_dtype not in SUPPORTED_COMPUTE_DTYPES:
        raise ValueError(f"patch: compute_dtype must be torch.bfloat16 or torch.float32 (bitmatch computes in bf16 "
                         f"or fp32), got {compute_dtype}: pass compute_dtype=torch.bfloat16")
    if compute_dtype is None:  # the kernels would meet e.g. fp16 only later, inside a norm: refuse now
        bad = unsupported_param_dtypes(lm)
        if bad:
            raise ValueError(unsupported_dtype_message("patch", ", ".join(bad),
                                                       "pass patch(model, compute_dtype=torch.bfloat16)"))
    check_model(lm, fam, check_quantization(quantization, "patch"), "patch")
    state = patch_state(lm)
    if state is None:
        state = PatchState(fam, compute_dtype)
        create_state(lm).patch = state
    state.compute_dtype = compute_dtype
    state.quantization = quantization
    _bind(lm, _causal_forward, state)
    create_state(lm.model).lm = lm  # the base model's forward runs the whole LM (a deepcopy maps it too)
    _bind(lm.model, _base_forward, state)
    for mod, fn in fam.patch_modules(lm):
        _bind(mod, fn, state)
    return model


def unpatch(model):
    """Undo ``patch``: every module's own forward again (parameters untouched), and the state patch
    kept on the model dropped (the fused copies an engine derived stay: its CUDA graphs read them);
    returns ``model``."""
    lm = unwrap_causal_lm(model)
    for mod in lm.modules():
        bf = bound_forward(mod)
        if bf is None:
            continue
        if bf.saved is None:
            del mod.__dict__["forward"]
        else:
            mod.forward = bf.saved
    drop_state(lm, "patch", "spec")
    drop_state(lm.model, "lm")
    return model


def is_patched(model) -> bool:
    return patch_state(unwrap_causal_lm(model)) is not None
