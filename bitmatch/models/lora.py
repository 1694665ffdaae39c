"""PEFT LoRA on bitmatch kernels: the trainer computes with the merged weight the rollout receives.

A rollout engine fed by TRL gets merged weights (``merge_adapter``: ``W += s * B @ A``), so it
computes ``x @ (W + s·B·A)^T``, while a stock LoRA forward computes ``x @ W^T + s·(x @ A^T) @ B^T``:
other roundings, other bits. Here the trainer's forward of a LoRA layer is
``kernels.linear(x, compute_cast(merged_weight(layer)))``, where ``merged_weight`` runs the very
arithmetic of PEFT's merge (``get_delta_weight`` added in place to a copy of the base weight),
and the rollout copy is filled by the same function. The gradients of A and B (and of W if it
trains) are computed analytically in backward, from the same merged weight, in the compute dtype:

    y = x Wm^T,  Wm = W + s B A   =>   dx = gy Wm,  dA = s (gy B)^T x,  dB = s gy^T (x A^T)

Rollout (no autograd recording): the cast merged weight is computed once and kept
(``rollout_weight``), keyed on the data pointers and version counters of W, A and B and on the
active adapters and their scalings; a change recomputes it IN PLACE, so a CUDA graph that reads
it stays valid (``refresh_rollout_weights`` runs before a replay, as the dense family's fused
copies). The kept tensor is the very ``cast(merged_weight)`` the trainer's forward computes: the
same bits, without re-merging every layer on every decode step.

Supported: PEFT ``lora.Linear`` layers with plain LoRA (no DoRA / other variants, no
``lora_bias``, ``fan_in_fan_out=False``) and no active dropout in training (set
``LoraConfig(lora_dropout=0.0)`` or ``GRPOConfig(disable_dropout=True)``): dropout on the
adapter branch has no merged equivalent. Anything else raises an error naming the fix.
"""
from __future__ import annotations

import contextlib
import threading

import torch
from torch.utils.weak import WeakIdKeyDictionary

import bitmatch.kernels as K
import bitmatch.precision as precision
from bitmatch.models.state import create_state, drop_state, get_state
from bitmatch.precision import cast_param, compute_cast

__all__ = ["is_lora_layer", "merged_weight", "linear", "merged_state_dict", "check_lora_layer", "rollout_weight",
           "refresh_rollout_weights", "graph_capturable", "kept_weights", "kept_casts",
           "drop_kept_weights"]


def is_lora_layer(mod) -> bool:
    """True for a PEFT LoRA adapter layer (it holds ``base_layer`` and ``lora_A``)."""
    return hasattr(mod, "lora_A") and hasattr(mod, "base_layer")


def _active(mod) -> list[str]:
    return [a for a in mod.active_adapters if a in mod.lora_A.keys()]


def check_lora_layer(mod, name: str = "") -> None:
    """Raise ValueError (naming the LoraConfig option to change) unless bitmatch can run ``mod``."""
    where = f" ({name})" if name else ""
    if not hasattr(mod, "get_delta_weight") or not isinstance(mod.get_base_layer(), torch.nn.Linear):
        raise ValueError(f"bitmatch: {type(mod).__name__}{where} is not a PEFT LoRA Linear layer; only "
                         "lora.Linear on nn.Linear base layers is supported")
    if getattr(mod, "fan_in_fan_out", False):
        raise ValueError(f"bitmatch: LoRA layer{where} has fan_in_fan_out=True; use LoraConfig(fan_in_fan_out=False)")
    for a in _active(mod):
        if a in getattr(mod, "lora_variant", {}):
            raise ValueError(f"bitmatch: LoRA adapter {a!r}{where} uses a variant (e.g. DoRA); only plain LoRA "
                             "is supported: LoraConfig(use_dora=False)")
        if getattr(mod, "lora_bias", {}).get(a, False):
            raise ValueError(f"bitmatch: LoRA adapter {a!r}{where} has lora_bias=True; use LoraConfig(lora_bias=False)")


def merged_weight(mod) -> torch.Tensor:
    """The base weight with every active, unmerged adapter added: the bits PEFT's ``merge`` writes
    (same ``get_delta_weight``, same in-place add in the base weight's dtype), as a new tensor.

    Invariance: a pure function of W, A, B and the scaling; the trainer's forward and the
    weights pushed to the rollout both come from it.
    """
    check_lora_layer(mod)
    base = mod.get_base_layer()
    with torch.no_grad():
        w = base.weight.detach().clone()
        if mod.disable_adapters:
            return w
        merged = set(getattr(mod, "merged_adapters", []))
        for a in _active(mod):
            if a not in merged:
                w += mod.get_delta_weight(a)   # peft merge: base_layer.weight.data += delta_weight
    return w


# the kept cast merged weights of the rollout (inference only): {dtype: [key, tensor]} under this
# name in the LoRA layer's ModelState (``derived``), so they go with the layer
_ROLLOUT = "lora_rollout"
_state = threading.local()


@contextlib.contextmanager
def kept_weights(on: bool = True):
    """Inside the block, inference forwards of LoRA layers read the kept merged weight. The
    engine's paged steps only (as the dense family's fused copies): the engine refreshes it
    (forced) whenever it starts work, so a weight written through ``param.data`` (no version
    bump) cannot leave a stale copy in a trainer's no-grad forward, which always re-merges."""
    prev = getattr(_state, "on", False)
    _state.on = bool(on)
    try:
        yield
    finally:
        _state.on = prev


def kept_on() -> bool:
    """Whether the current forward is an engine step reading kept weights (``kept_weights``)."""
    return getattr(_state, "on", False) and not torch.is_grad_enabled() and not torch.is_inference_mode_enabled()


def fusable(mod) -> bool:
    """Whether an engine step may run ``mod`` inside a fused projection (dense's q/k/v, gate/up):
    a runnable LoRA layer in a kept-weights step, whose fused part is ``fused_part``."""
    if not kept_on() or (mod.disable_adapters and mod.merged):
        return False
    try:
        check_lora_layer(mod)
    except ValueError:
        return False
    return True


def fused_key(mod):
    """What the fused part of ``mod`` depends on: the kept weight's key and the base bias."""
    b = getattr(mod.get_base_layer(), "bias", None)
    return _rollout_key(mod, _live(mod)), None if b is None else (b.data_ptr(), b._version)


def fused_part(mod, dtype: torch.dtype):
    """(weight, bias) of ``mod`` cast to ``dtype`` for a fused projection: ``rollout_weight``'s
    bits (the cast merged weight; the base weight itself when no adapter is live, as ``linear``)
    computed afresh, not kept twice: the fused copy is the kept weight."""
    w = cast_param(merged_weight(mod), dtype)
    return w, getattr(mod.get_base_layer(), "bias", None)


def _live(mod) -> list[str]:
    merged = set(getattr(mod, "merged_adapters", []))
    return [] if mod.disable_adapters else [a for a in _active(mod) if a not in merged]


def _rollout_key(mod, live):
    ps = [mod.get_base_layer().weight] + [t for a in live for t in (mod.lora_A[a].weight, mod.lora_B[a].weight)]
    return (tuple((p.data_ptr(), p._version) for p in ps), tuple(live), tuple(float(mod.scaling[a]) for a in live))


def _store(entry, w, key):
    """entry = [key, tensor] takes ``w``: in place where it fits (a captured graph keeps reading
    the old address), else the new tensor."""
    if entry[1] is not None and entry[1].shape == w.shape and entry[1].dtype == w.dtype:
        entry[1].copy_(w)
    else:
        entry[1] = w
    entry[0] = key


def _fill(entry, mod, dtype, key):
    with torch.no_grad():
        _store(entry, cast_param(merged_weight(mod), dtype), key)


def rollout_weight(mod, dtype: torch.dtype, force: bool = False) -> torch.Tensor:
    """``cast_param(merged_weight(mod), dtype)``, kept between calls and recomputed in place when
    W, A, B (pointer or version), the active adapters or their scalings change (``force``: always).

    Invariance: the same bits as the trainer's merged forward weight; only when it is computed
    differs. Inference only (outside inference mode, whose tensors carry no version counter)."""
    live = _live(mod)
    key = _rollout_key(mod, live)
    entry = create_state(mod).derived.setdefault(_ROLLOUT, {}).setdefault(dtype, [None, None])
    if force or entry[0] != key:
        _fill(entry, mod, dtype, key)
    return entry[1]


def refresh_rollout_weights(lm, force: bool = False) -> None:
    """Bring every kept rollout weight of ``lm``'s LoRA layers, and every kept parameter cast,
    up to date in place (before a CUDA graph replay, which runs no host code)."""
    for m in lm.modules():
        for dtype in list(rollout_weights_of(m)):
            rollout_weight(m, dtype, force)
    for p in lm.parameters():
        for dtype, entry in _KEPT_CASTS.get(p, {}).items():
            _cast_into(entry, p, dtype, force)


# Parameters cast at use (fp32 masters, bf16 compute: norms, the LM head, plain linears) read in
# an engine step: the cast kept between steps, keyed on the parameter's pointer and version and
# refreshed in place (the rollout_weight rule), so a decode step stops re-casting every one of
# them (a TRL LoRA step on shared fp32 weights re-cast its whole untied LM head per token).
_KEPT_CASTS = WeakIdKeyDictionary()   # Parameter -> {dtype: [key, cast tensor]}


def _cast_into(entry, p, dtype, force=False):
    key = (p.data_ptr(), p._version)
    if force or entry[0] != key:
        with torch.no_grad():
            _store(entry, compute_cast(p.detach(), dtype), key)
    return entry[1]


def _kept_cast(p, dtype):
    """cast_param's engine-step path (precision.set_kept_cast): None outside a kept-weights step."""
    if not kept_on():
        return None
    per = _KEPT_CASTS.get(p)
    if per is None:
        per = _KEPT_CASTS[p] = {}
    return _cast_into(per.setdefault(dtype, [None, None]), p, dtype)


precision.set_kept_cast(_kept_cast)


def kept_casts(p) -> dict:
    """``{dtype: cast}`` the engine keeps of parameter ``p`` (empty if none)."""
    return {dt: e[1] for dt, e in _KEPT_CASTS.get(p, {}).items() if e[1] is not None}


def drop_kept_weights(lm) -> None:
    """Forget every copy the engine derived from ``lm``'s parameters: fused copies and kept rollout
    weights (each module's ``derived`` state) and the kept casts of its parameters. The next engine
    step rebuilds them; an engine's last ``close()`` calls this, so the model holds only its own
    tensors again (an fp32 model computed in bf16 keeps a bf16 copy of most of its weights)."""
    for m in lm.modules():
        drop_state(m, "derived")
    for p in lm.parameters():
        _KEPT_CASTS.pop(p, None)


def rollout_weights_of(mod) -> dict:
    """``{dtype: [key, weight]}``: what ``rollout_weight`` keeps for ``mod`` (empty if nothing)."""
    st = get_state(mod)
    return {} if st is None else st.derived.get(_ROLLOUT, {})


def graph_capturable(lm) -> bool:
    """True when every LoRA layer of ``lm`` runs through ``linear`` below (a PEFT ``lora.Linear``
    that ``check_lora_layer`` accepts), whose inference forward reads only the kept weight."""
    for n, m in lm.named_modules():
        if is_lora_layer(m):
            try:
                check_lora_layer(m, n)
            except ValueError:
                return False
    return True


def _check_dropout(mod) -> None:
    if not mod.training:
        return
    for a in _active(mod):
        d = mod.lora_dropout[a]
        if isinstance(d, torch.nn.Dropout) and d.p > 0:
            raise ValueError(f"bitmatch: LoRA adapter {a!r} has lora_dropout={d.p} in training: dropout on the "
                             "adapter branch has no merged-weight equivalent, so the rollout cannot match it. "
                             "Use LoraConfig(lora_dropout=0.0) or GRPOConfig(disable_dropout=True)")


class LoRAMergedLinearFunction(torch.autograd.Function):
    """y = kernels.linear(x, cast(Wm), cast(bias)); analytic gradients for x, W, bias, A_i, B_i."""

    @staticmethod
    def forward(ctx, x2d, weight, bias, mod, dtype, *ab):
        wm = merged_weight(mod)
        wc = cast_param(wm, dtype)
        with torch.no_grad():
            y = K.linear(x2d, wc, cast_param(bias.detach(), dtype) if bias is not None else None)
        ctx.scalings = [mod.scaling[a] for a in _active(mod) if a not in set(getattr(mod, "merged_adapters", []))]
        ctx.has_bias = bias is not None
        ctx.w_dtype = weight.dtype
        ctx.b_dtype = None if bias is None else bias.dtype
        ctx.save_for_backward(x2d, wc, *ab)
        return y

    @staticmethod
    def backward(ctx, gy):
        # gradients need only be correct, not invariant: stock matmuls in the compute dtype (bf16
        # GEMMs accumulate in fp32 and round once, as kernels.linear's backward; fp32 operands
        # made every LoRA layer's backward an fp32 GEMM, slower than the whole stock step)
        x2d, wc, *ab = ctx.saved_tensors
        ct = wc.dtype
        g = gy.to(ct)
        x = x2d.to(ct)
        needs = ctx.needs_input_grad
        gx = (g @ wc).to(x2d.dtype) if needs[0] else None
        gw = (g.t() @ x).to(ctx.w_dtype) if needs[1] else None
        gb = gy.float().sum(0).to(ctx.b_dtype) if ctx.has_bias and needs[2] else None
        grads = []
        for i in range(0, len(ab), 2):
            a, b = ab[i], ab[i + 1]
            s = ctx.scalings[i // 2]
            ga = (s * ((g @ b.to(ct)).t() @ x)).to(a.dtype) if needs[5 + i] else None
            gbm = (s * (g.t() @ (x @ a.to(ct).t()))).to(b.dtype) if needs[6 + i] else None
            grads += [ga, gbm]
        return (gx, gw, gb, None, None, *grads)


def linear(mod, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A PEFT LoRA layer on bitmatch kernels: ``x @ compute_cast(merged_weight(mod))^T (+ bias)``.

    Invariance: bit-identical to ``kernels.linear`` on the merged weight PEFT's merge produces,
    so a rollout holding merged weights reports the same logits.
    """
    check_lora_layer(mod)
    base = mod.get_base_layer()
    bias = getattr(base, "bias", None)
    live = _live(mod)
    if mod.disable_adapters and mod.merged:
        raise ValueError("bitmatch: LoRA layer has merged adapters but adapters are disabled; unmerge_adapter() "
                         "first (bitmatch never unmerges: W + d - d is not W)")
    if not live:  # merged already, or disabled: the base layer is the whole layer
        return K.linear(x, cast_param(base.weight, dtype), cast_param(bias, dtype))
    if kept_on():
        # the engine's step: the kept merged weight (same bits as LoRAMergedLinearFunction's forward)
        return K.linear(x, rollout_weight(mod, dtype), cast_param(bias, dtype))
    _check_dropout(mod)
    ab = []
    for a in live:
        ab += [mod.lora_A[a].weight, mod.lora_B[a].weight]
    lead = x.shape[:-1]
    x2d = x.reshape(-1, x.shape[-1]).contiguous()
    y = LoRAMergedLinearFunction.apply(x2d, base.weight, bias, mod, dtype, *ab)
    return y.reshape(*lead, y.shape[-1])


def plain_name(name: str) -> str:
    """A PEFT parameter name as the rollout knows it: TRL's rule (no ``base_model.model.`` prefix,
    no ``.base_layer``)."""
    return name.removeprefix("base_model.model.").replace(".base_layer", "")


def merged_state_dict(model) -> list[tuple[str, torch.Tensor]]:
    """(HF name, tensor) pairs of the weights a rollout must hold for ``model`` (a PEFT model or a
    plain one): merged weights for LoRA layers, the module's own tensors (detached) otherwise.
    Names follow TRL's push to vLLM; LoRA A/B parameters are folded into their layer's weight."""
    lora_mods = {n: m for n, m in model.named_modules() if is_lora_layer(m)}
    merged = {}
    for n, m in lora_mods.items():
        merged[plain_name(f"{n}.base_layer.weight")] = merged_weight(m)
    out, seen = [], set()
    for name, p in model.named_parameters(remove_duplicate=True):
        if ".lora_" in name or "lora_magnitude" in name:
            continue
        key = plain_name(name)
        if key in seen:
            continue
        seen.add(key)
        out.append((key, merged.get(key, p.detach())))
    return out
