"""Planted faults for ``bitmatch locate --inject`` (demos and tests): a perturbed weight, a stock
(non-invariant) torch version of one kernel, the other temperature formula. Each is applied to one
side of a pair only and undone afterwards. A kernel fault is the op table's stock counterpart of the
op (``kernels/stock.py``) swapped in by ``kernels.override``, the temperature fault the other formula
in place of ``token_logprobs`` by the same override: the stamp says so while it runs; nothing else
of the engine or the model is touched."""
from __future__ import annotations

import contextlib
import copy

import torch

import bitmatch.kernels as K
from bitmatch.kernels.table import OPS
from bitmatch.models import unwrap_causal_lm
from bitmatch.models.registry import tp_shard


def parse_inject(spec: str | None):
    """``weight:LAYER.PARAM`` | ``kernel:OP`` | ``temperature`` -> (kind, arg); ValueError otherwise."""
    if spec is None:
        return None
    kind, _, arg = spec.partition(":")
    if kind == "temperature" and not arg:
        return ("temperature", None)
    if kind == "kernel" and arg in OPS:
        return ("kernel", arg)
    if kind == "weight" and arg:
        return ("weight", arg)
    raise ValueError(f"locate: --inject must be weight:LAYER.PARAM (e.g. weight:1.mlp.down_proj), kernel:OP "
                     f"(OP one of {', '.join(OPS)}) or temperature; got {spec!r}")


def perturb_weight(model, target: str):
    """A deep copy of ``model`` whose parameter ``target`` ("1.mlp.down_proj" = layer 1's
    module or parameter; "lm_head", "model.norm" outside the layers) is scaled by 1 + 2^-5
    (every nonzero element changes its bits in bf16 and fp32). Refused for a tensor-parallel rank: the
    copy would run as one process (a copy keeps no layout), not as the rank it is compared with."""
    if tp_shard(unwrap_causal_lm(model)) is not None:
        raise ValueError(f"locate: --inject weight:{target} on a tensor-parallel rank: the perturbed copy would run "
                         "as one process; plant kernel:OP instead (it runs on the rank's layout)")
    m = copy.deepcopy(model)
    lm = unwrap_causal_lm(m)
    head, _, rest = target.partition(".")
    paths = [f"model.layers.{head}.{rest}"] if head.isdigit() else [target, f"model.{target}"]
    for path in paths:
        for cand in (path, path + ".weight"):
            try:
                p = lm.get_parameter(cand)
            except AttributeError:
                continue
            with torch.no_grad():
                p.mul_(1 + 2 ** -5)
            return m
    raise ValueError(f"locate: --inject weight:{target}: no parameter {' or '.join(paths)}[.weight] in "
                     f"{type(lm).__name__}")


@contextlib.contextmanager
def kernel_fault(op: str | None):
    """Inside the block ``bitmatch.kernels.<op>`` is its stock torch counterpart (the op table's)."""
    if op is None:
        yield
        return
    with K.override({op: OPS[op].stock}):
        yield


def reciprocal_temperature_logprobs(logits, targets, temperature):
    """The planted temperature formula, in ``token_logprobs``' signature: the logprobs of
    logits * (1/T) at T = 1 (HF/TRL's ``logits / T`` with a float, as CUDA runs it) instead of the
    division by T both bitmatch paths use. A per-row temperature tensor (the engine's sampler) goes
    to the op's autograd Function directly, as the sampler's own call does: no argument checks, so
    the fault runs inside a captured decode graph too."""
    canonical = OPS["token_logprobs"].canonical
    if isinstance(temperature, torch.Tensor):
        t = temperature.to(device=logits.device, dtype=torch.float32)
        scaled = logits.float() * (1.0 / t).reshape(-1, 1)
        return K.logprobs.TokenLogprobsFunction.apply(scaled.contiguous(), targets, torch.ones_like(t))
    return canonical(logits.float() * (1.0 / temperature), targets, 1.0)


@contextlib.contextmanager
def engine_temperature_fault(on: bool):
    """Inside the block ``bitmatch.kernels.token_logprobs`` is ``reciprocal_temperature_logprobs``
    (``kernels.override``): the engine's reported logprobs from logits * (1/T) instead of logits / T."""
    if not on:
        yield
        return
    with K.override({"token_logprobs": reciprocal_temperature_logprobs}):
        yield
