"""The op table: every public op of ``bitmatch.kernels`` declared once, and the one undoable override.

Each ``OpSpec`` says what the op guarantees (its invariance ``axes``), which plain-torch function
stands in for it (``stock``, from ``kernels/stock/``), where it runs (``backends``) and which
entry of the canonical order's ``op_versions`` versions its bits (``family``, the ``kernels/``
module that defines it). What ``bitmatch check --family`` tests, what ``--inject kernel:OP`` swaps
in and what the benchmarks' stock baseline runs are read from here, never from a docstring.

Axes (the harness each one calls for):

- ``rows``: each output row depends only on that row's inputs: the batch harness
  (``testing.assert_batch_invariant``) applies to the op alone;
- ``batch``: a sequence's output does not depend on the other sequences of the call;
- ``schedule``: a token's output does not depend on how its sequence was split into calls
  (prefill, chunked prefill, decode): ``testing.assert_schedule_invariant`` or the model row;
- ``state``: the op reads or writes per-sequence state across calls (KV / conv / SSM caches).

``override({"linear": fn, ...})`` swaps what every caller reaches through ``bitmatch.kernels``
(callers call ``K.op`` at call time; ``tests/test_op_table.py`` fails if a module binds an op by
name). Ops inside ``kernels/`` that compose other ops (``hc_pre`` on ``linear``) bind their parts at
import: that composition is part of their own definition and order version. While an override is
active the canonical order's ``overridden_ops`` names the ops, so ``order.stamp()`` (and every sync
manifest) cannot claim the canonical order while a stock op or a fault runs.
"""
from __future__ import annotations

import contextlib
import importlib
import sys
import threading
from dataclasses import dataclass
from typing import Callable, Mapping

from . import order, stock

AXES = ("rows", "batch", "schedule", "state")
# exported callables that are not ops: backend choice and input-check helpers, the override itself
# (``KeyRows``: the row addressing the V4 row ops take, a dataclass)
HELPERS = frozenset({"use_backend", "backend_for", "host_readable", "check_on_device", "override", "KeyRows"})

_PACKAGE = __name__.rpartition(".")[0]   # "bitmatch.kernels": this module is imported by its __init__


@dataclass(frozen=True)
class OpSpec:
    """One public op: ``name`` in ``bitmatch.kernels``, defined in ``kernels/<family>.py`` (its key in
    the canonical order's ``op_versions``); ``axes`` from ``AXES``; ``backends``: "reference" (exact
    CPU), "triton" (CUDA, or CPU under the interpreter), "torch" (the same torch ops on every device);
    ``stock``: the plain-torch counterpart with the same signature."""
    name: str
    family: str
    axes: tuple
    backends: tuple
    stock: Callable

    @property
    def row_wise(self) -> bool:
        """True when the batch harness applies to the op alone (the ``rows`` axis)."""
        return "rows" in self.axes

    @property
    def canonical(self) -> Callable:
        """The op as its module defines it (what ``bitmatch.kernels.<name>`` is without an override)."""
        return getattr(importlib.import_module(f"{_PACKAGE}.{self.family}"), self.name)

    @property
    def version(self) -> int:
        """The active canonical order's version of this op's family."""
        return order.current().op_version(self.family)


_RT = ("reference", "triton")
_ROWS = ("rows", "batch")
_SEQ = ("batch", "schedule")
_STATE = ("batch", "schedule", "state")
OPS: dict[str, OpSpec] = {s.name: s for s in (
    OpSpec("linear", "linear", _ROWS, _RT, stock.linear),
    # block FP8 W8A8: per-token 128-group activation scales, so rows stay independent
    OpSpec("quantize_fp8_groups", "fp8", _ROWS, _RT, stock.quantize_fp8_groups),
    OpSpec("fp8_linear", "fp8", _ROWS, _RT, stock.fp8_linear),
    OpSpec("fp8_linear_master", "fp8", _ROWS, _RT, stock.fp8_linear_master),
    OpSpec("rms_norm", "norm", _ROWS, _RT, stock.rms_norm),
    OpSpec("fused_add_rms_norm", "norm", _ROWS, _RT, stock.fused_add_rms_norm),
    OpSpec("silu_and_mul", "activation", _ROWS, _RT, stock.silu_and_mul),
    # one row per position: rows of a table, the same function of the position on every backend
    OpSpec("rotary_cos_sin", "rotary", _ROWS, ("reference",), stock.rotary_cos_sin),
    OpSpec("apply_rotary", "rotary", _ROWS, _RT, stock.apply_rotary),
    OpSpec("apply_rotary_interleaved", "rotary_interleaved", _ROWS, _RT, stock.apply_rotary_interleaved),
    OpSpec("attention_prefill", "attention", _SEQ, _RT, stock.attention_prefill),
    OpSpec("attention_paged", "attention", _STATE, _RT, stock.attention_paged),
    OpSpec("attention_decode", "attention", _STATE, _RT, stock.attention_decode),
    OpSpec("write_kv_cache", "attention", ("batch", "state"), ("torch",), stock.write_kv_cache),
    OpSpec("token_logprobs", "logprobs", _ROWS, _RT, stock.token_logprobs),
    OpSpec("full_logprobs", "logprobs", _ROWS, _RT, stock.full_logprobs),
    # the mask is per row: its sort and integer prefix sums run along the vocabulary, not the batch
    OpSpec("top_k_top_p_mask", "sampling", _ROWS, _RT, stock.top_k_top_p_mask),
    OpSpec("apply_top_k_top_p", "sampling", _ROWS, _RT, stock.apply_top_k_top_p),
    OpSpec("categorical_sample", "sampling", _ROWS, _RT, stock.categorical_sample),
    OpSpec("uniform_noise", "sampling", _ROWS, ("torch",), stock.uniform_noise),
    OpSpec("moe_route", "moe", _ROWS, _RT, stock.moe_route),
    OpSpec("moe_scores", "moe", _ROWS, _RT, stock.moe_scores),
    OpSpec("moe_experts", "moe", _ROWS, _RT, stock.moe_experts),
    OpSpec("moe_combine", "moe", _ROWS, _RT, stock.moe_combine),
    OpSpec("sink_attention", "compressed_attention", _SEQ, _RT, stock.sink_attention),
    # every row of a step (trainer's packed rows or the engine's paged caches) through one KeyRows
    OpSpec("sink_attention_rows", "compressed_attention", _STATE, _RT, stock.sink_attention_rows),
    OpSpec("compress_windows", "compressor", _SEQ, _RT, stock.compress_windows),
    # every row's window read from a per-token store through one KeyRows (the engine's caches)
    OpSpec("compress_rows", "compressor", _STATE, _RT, stock.compress_rows),
    OpSpec("indexer_topk", "indexer", _SEQ, _RT, stock.indexer_topk),
    OpSpec("indexer_select", "indexer", _STATE, _RT, stock.indexer_select),
    OpSpec("hc_pre", "mhc", _ROWS, _RT, stock.hc_pre),
    OpSpec("hc_post", "mhc", _ROWS, ("torch",), stock.hc_post),
    OpSpec("hc_head", "mhc", _ROWS, _RT, stock.hc_head),
    OpSpec("causal_conv1d", "mamba", _STATE, _RT, stock.causal_conv1d),
    OpSpec("mamba_chunk_scan", "mamba", _STATE, _RT, stock.mamba_chunk_scan),
    OpSpec("gated_rms_norm", "mamba", _ROWS, _RT, stock.gated_rms_norm),
)}


def spec(name: str) -> OpSpec:
    """The table entry of op ``name``; KeyError naming the ops otherwise."""
    try:
        return OPS[name]
    except KeyError:
        raise KeyError(f"bitmatch.kernels: no op {name!r} in the op table; ops: {', '.join(OPS)}") from None


def stock_for(names=None) -> dict:
    """{op: its stock counterpart} for ``names`` (default: every op): an ``override`` argument."""
    return {n: spec(n).stock for n in (OPS if names is None else names)}


def overridden() -> dict:
    """{op: the function now reached through ``bitmatch.kernels``} for every op not its canonical one."""
    pkg = sys.modules[_PACKAGE]
    return {n: getattr(pkg, n) for n, s in OPS.items() if getattr(pkg, n) is not s.canonical}


# One process-wide stack, like the canonical order's: a kernel called from any thread reaches the
# overriding function, and only one thread at a time may hold overrides, so two threads can never
# restore each other's functions.
_lock = threading.Lock()
_stack: list[dict] = []
_owner: int | None = None


@contextlib.contextmanager
def override(ops: Mapping[str, Callable]):
    """Inside the block ``bitmatch.kernels.<op>`` is ``ops[op]`` for every op named, for every caller
    (callers reach ops as ``K.op``); the canonical order's ``overridden_ops`` names them, so the
    stamp reports the override. Nests (an inner block starts from the outer one's functions);
    the previous functions are back on exit, exception or not. Yields {op: the function replaced}."""
    global _owner
    bad = [n for n in ops if n not in OPS]
    if bad:
        raise KeyError(f"kernels.override: {bad} are not ops of the op table (kernels/table.py); ops: {', '.join(OPS)}")
    not_callable = [n for n, f in ops.items() if not callable(f)]
    if not_callable:
        raise TypeError(f"kernels.override: the replacement for {not_callable} is not callable; pass a function "
                        "with the op's signature (e.g. kernels.table.OPS[op].stock)")
    pkg, me = sys.modules[_PACKAGE], threading.get_ident()
    with _lock:
        if _owner is not None and _owner != me:
            raise RuntimeError("kernels.override: another thread holds an op override; ops are process-wide, so "
                               "overrides from two threads cannot nest")
        saved = {n: getattr(pkg, n) for n in ops}
        _stack.append(saved)
        _owner = me
        for n, f in ops.items():
            setattr(pkg, n, f)
    try:
        marked = tuple(sorted(set(order.current().overridden_ops) | set(ops)))
        with order.override(overridden_ops=marked):
            yield dict(saved)
    finally:
        with _lock:
            for n, f in _stack.pop().items():
                setattr(pkg, n, f)
            if not _stack:
                _owner = None


__all__ = ["AXES", "HELPERS", "OpSpec", "OPS", "spec", "stock_for", "overridden", "override"]
