"""A host-read detector that works on CPU: every op that reads tensor values back to the host.

On CUDA each such read is a sync (the CPU stalls until the GPU drains) or a shape that depends on
data (either breaks a graph capture and keeps Python's launch overhead from hiding behind GPU
work). On CPU tensors they are free, so a test runs the Triton backend in the interpreter on CPU
tensors and records them here instead: the dispatcher-level reads (``item``/``int``/``float``/
``bool`` all reach ``aten._local_scalar_dense``; ``nonzero``, ``unique``, boolean-mask indexing,
``repeat_interleave`` without ``output_size``, ...) and the Python-level ``tolist``/``numpy``
(which do not dispatch on CPU tensors). Work the interpreter does on the launch arguments is
device work on a GPU and is not counted.
"""
from __future__ import annotations

import contextlib
import os
import traceback

import torch
from torch.utils._python_dispatch import TorchDispatchMode

READS = {torch.ops.aten._local_scalar_dense, torch.ops.aten.nonzero, torch.ops.aten._unique2,
         torch.ops.aten._unique, torch.ops.aten.unique_dim, torch.ops.aten.unique_consecutive,
         torch.ops.aten.masked_select, torch.ops.aten.bincount, torch.ops.aten.equal,
         torch.ops.aten.is_nonzero}
_PY_READS = ("tolist", "numpy")


def where(depth: int = 3) -> str:
    """Who asked: the ``depth`` innermost frames outside torch and this file, innermost first."""
    out = []
    for fr in reversed(traceback.extract_stack()[:-2]):
        if f"{os.sep}torch{os.sep}" not in fr.filename and fr.filename != __file__:
            out.append(f"{os.path.basename(fr.filename)}:{fr.lineno} {fr.name}")
    return " <- ".join(out[:depth])


def in_interpreter() -> bool:
    # the interpreter stands in for the GPU: its copies of the launch arguments are device work
    return any(f"triton{os.sep}runtime{os.sep}interpreter.py" in fr.filename for fr in traceback.extract_stack())


class _HostReads(TorchDispatchMode):
    def __init__(self, depth: int):
        super().__init__()
        self.depth = depth
        self.reads: list[tuple[str, str]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        bool_index = func.overloadpacket in (torch.ops.aten.index, torch.ops.aten.index_put_,
                                             torch.ops.aten.index_put) and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] if len(args) > 1 else ()) or ())
        data_repeats = func is torch.ops.aten.repeat_interleave.Tensor and kwargs.get("output_size") is None
        if (func.overloadpacket in READS or bool_index or data_repeats) and not in_interpreter():
            self.reads.append((str(func.overloadpacket), where(self.depth)))
        return func(*args, **kwargs)


@contextlib.contextmanager
def host_reads(depth: int = 3):
    """Yields the list of ``(what, where)`` host reads made inside the block (also in autograd's
    backward when it runs inside the block: the engine runs on this thread)."""
    mode = _HostReads(depth)
    saved = {n: getattr(torch.Tensor, n) for n in _PY_READS}

    def spy(name):
        def f(self, *a, **kw):
            if not in_interpreter():
                mode.reads.append((f"Tensor.{name}", where(depth)))
            return saved[name](self, *a, **kw)
        return f
    try:
        for n in saved:
            setattr(torch.Tensor, n, spy(n))
        with mode:
            yield mode.reads
    finally:
        for n, f in saved.items():
            setattr(torch.Tensor, n, f)


def dispatched_ops(fn) -> int:
    """How many torch ops fn() dispatches (forward and backward): the host cost a GPU step pays per op."""
    class _Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            _Count.n += 1
            return func(*args, **(kwargs or {}))
    with _Count():
        fn()
    return _Count.n
