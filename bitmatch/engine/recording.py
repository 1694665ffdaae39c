"""Recording engine steps without changing them: ``Engine.record(recorder)``.

A diagnostic (``bitmatch locate --pair engine``, a test) attaches a recorder; the engine hands it
every op output of every step it runs while attached and nothing else changes: a step takes the
path it takes unrecorded. Eager steps call the recorder from the forward (``forward_hidden``'s
``recorder``). Pure-decode steps still replay a CUDA graph: a recording graph is captured from
the same forward, LM head and sampler on the same padded bucket, plus a device copy of each op
output into a graph-owned tensor (``GraphTap``); after the replay the copies go to the recorder.
The copies only read, so every op of a recorded step runs the kernels, shapes and inputs of the
unrecorded step and writes the same bits (tests/test_diagnostics_observe.py).

The protocol (``bitmatch.diagnostics.tracing.Recorder`` implements it):

* ``recorder.step(view)``: once per step, before its records; ``view`` a ``StepView``;
* ``recorder.record(name, value, rows)``: per op output (the forward's names, then ``lm_head``);
  ``value`` a tensor or a tuple of tensors, ``rows`` the (sequence id, position) of each row of a
  per-token value's first dimension, None for a graph's padded row that no sequence owns. The
  tensors are the engine's own (graph-owned in a replay): copy what you keep before returning.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from bitmatch.context import ForwardContext


@dataclass(frozen=True)
class StepView:
    """What a recorder learns about a step before its records.

    ``path``: "eager", "graph" (a CUDA graph replay) or "simulated graph" (the same padded inputs
    run eagerly: ``simulate_buckets``, CPU tests). ``rows``: (sequence id, position) of each row
    the forward ran, None for padding. ``ctx``: the ForwardContext the forward read (a graph's:
    its input buffers, padded rows included)."""
    index: int
    path: str
    rows: tuple
    ctx: ForwardContext


class GraphTap:
    """A forward's ``recorder`` inside a captured step: a device copy of each op output, kept in
    ``outputs`` as [(name, tensors)]; in a graph the copies are part of the graph, so every replay
    refreshes them."""

    def __init__(self):
        self.outputs: list[tuple[str, tuple[torch.Tensor, ...]]] = []

    def __call__(self, name: str, value) -> None:
        vals = value if isinstance(value, (tuple, list)) else (value,)
        self.outputs.append((name, tuple(v.detach().clone() for v in vals)))


def step_rows(seq_ids, positions, padded: int = 0) -> tuple:
    """(sequence id, position) per forward row from the step's host arrays, then ``padded`` Nones."""
    return tuple(zip(seq_ids, positions)) + (None,) * padded


def begin(recorders, view: StepView):
    """Tell every recorder the step ``view``; the forward's ``recorder(name, value)`` of the step:
    each op output to every recorder, keyed by ``view.rows``."""
    for r in recorders:
        r.step(view)

    def record(name, value):
        for r in recorders:
            r.record(name, value, view.rows)
    return record


def emit(recorders, view: StepView, outputs) -> None:
    """A captured step's records after it ran: ``view``, then each of ``outputs`` [(name, tensors)]."""
    record = begin(recorders, view)
    for name, value in outputs:
        record(name, value)
