"""Planted faults for ``bitmatch locate --inject`` (demos and tests): a perturbed weight, a stock
(non-invariant) torch version of one kernel, the other temperature formula. Each is applied to one
side of a pair only and undone afterwards. A kernel fault is the op table's stock counterpart of the
op (``kernels/stock.py``) swapped in by ``kernels.override``: the stamp says so while it runs."""
from __future__ import annotations

import contextlib
import copy

import torch

import bitmatch.engine.sampling as S
import bitmatch.kernels as K
from bitmatch.kernels.table import OPS
from bitmatch.models import unwrap_causal_lm


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
    (every nonzero element changes its bits in bf16 and fp32)."""
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


@contextlib.contextmanager
def engine_temperature_fault(on: bool):
    """The engine's reported logprobs from logits * (1/T) instead of logits / T."""
    if not on:
        yield
        return
    orig = S.reported_logprobs
    S.reported_logprobs = lambda logits, tokens, temps: orig(logits.float() * (1.0 / temps)[:, None], tokens,
                                                           torch.ones_like(temps))
    try:
        yield
    finally:
        S.reported_logprobs = orig
