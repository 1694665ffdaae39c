"""The stock controls of ``bitmatch check`` (and ``check --family``, and the GPU benchmark): one
definition per device of the stock computations the contract replaces, each run through the same
comparison the invariant ops pass: the op table's stock op (``kernels/stock.py``) swapped in by
``kernels.override`` under the harness that calls ``K.op``. Every control must find a mismatch on its device; one that
finds none means the harness did not show, on this machine, that it can fail, and the check fails.

The sizes are where the stock kernels are known to change bits (measured, see docs/design.md section 4),
not tuned until a row fails:

* CPU: fp32 ``F.linear`` takes another BLAS path for one row than for many; torch SDPA with
  boolean masks differs between full prefill, chunked prefill and decode; vLLM's temperature
  (``logits / t``, a per-row tensor: a true division) vs TRL's fused head (``logits * (1 / T)``).
* CUDA: fp32 ``F.linear`` as on the CPU; bf16 cuBLAS at real widths (4096x4096, and the 8B
  down projection 12288 -> 4096), where one row alone takes the GEMV path and large M another
  reduction order; SDPA (flash) as an engine calls it, one-token decode against a 2,048-token
  cached context vs the same row of the ``is_causal`` prefill (flash-decoding splits the keys);
  the temperature formulas on per-row tensors at a realistic logit scale (N(0, 4) over Qwen's
  151,936 vocabulary). On CUDA a division by a Python float runs as a multiplication by its
  reciprocal, so ``x / T`` vs ``x * (1 / T)`` with a float T is the same kernel there and cannot
  be a control; with a temperature tensor the division is a true one.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

import bitmatch.kernels as K
from bitmatch.kernels import stock
from bitmatch.kernels.table import OPS
from bitmatch.testing import BitMismatch, assert_batch_invariant, assert_bitwise_equal, assert_schedule_invariant

# an engine runs FlashAttention; torch 2.11 chooses cuDNN attention first on the H200, which builds an
# execution plan per new key length: 90 s for one 2,048-step decode case there, 2 s on flash
# (benchmarks/results/check_cuda_h200.json). Masked chunks run on the efficient or math backend.
_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


@dataclass(frozen=True)
class Control:
    """One stock control: ``run()`` raises ``BitMismatch`` when it finds a mismatch (what it must
    do) and returns the number of cases it ran without finding one otherwise."""
    name: str
    axes: str
    run: Callable[[], int]


def _rand(g, device, *shape, scale=1.0, dtype=None):
    x = torch.randn(*shape, generator=g) * scale
    return (x.to(dtype) if dtype is not None else x).to(device)


def linear_control(device, n_out, n_in, rows=16, max_batch=4096, dtype=None, cases=20, seed=0) -> int:
    """The op table's stock ``linear`` (``F.linear``) swapped in by ``kernels.override``, under the
    batch harness on ``K.linear``: each of ``rows`` rows alone (M = 1) vs inside random batches of up
    to ``max_batch`` rows, weights of ``n_out x n_in``."""
    g = torch.Generator().manual_seed(seed)
    dtype = dtype or torch.float32
    w = _rand(g, device, n_out, n_in, scale=n_in ** -0.5, dtype=dtype)
    x = _rand(g, device, rows, n_in, dtype=dtype)
    with K.override({"linear": OPS["linear"].stock}):
        assert_batch_invariant(lambda r: K.linear(r, w), x, max_batch=max_batch, cases=cases, seed=seed)
    return cases


def sdpa_control(device, lens, q_heads, kv_heads, head_dim, engine_style, cases=8, seed=1,
                 block_sizes=(8, 16, 32, 64)) -> int:
    """Stock torch SDPA (the op table's, per sequence) swapped in for ``attention_prefill`` and
    ``attention_paged`` by ``kernels.override``, through the schedule harness (full prefill vs packed,
    chunked prefill and one-token decode against a paged cache). ``engine_style``: called as an
    engine calls it (``is_causal`` prefill, unmasked one-token decode), else with boolean masks."""
    g = torch.Generator().manual_seed(seed)
    seqs = [tuple(_rand(g, device, n, h, head_dim, dtype=torch.bfloat16) for h in (q_heads, kv_heads, kv_heads))
            for n in lens]

    def prefill(q, k, v, cu, scale, causal=True, sliding_window=None, **_):
        with sdpa_kernel(_SDPA_BACKENDS):
            return stock.sdpa_prefill(q, k, v, cu, scale, sliding_window, engine_style=engine_style, causal=causal)

    def paged(q, kc, vc, bt, qsl, lens, scale, sliding_window=None, **_):
        with sdpa_kernel(_SDPA_BACKENDS):
            return stock.sdpa_paged(q, kc, vc, bt, qsl, lens, scale, sliding_window, engine_style=engine_style)
    with K.override({"attention_prefill": prefill, "attention_paged": paged}):
        assert_schedule_invariant(seqs, head_dim ** -0.5, cases=cases, seed=seed, block_sizes=block_sizes)
    return cases


def engine_logprobs(logits, t):
    """vLLM's sampler: the op table's stock ``full_logprobs``, fp32 logits divided by the per-row
    temperature tensor (a true division), full log_softmax."""
    return OPS["full_logprobs"].stock(logits, t)


def trainer_logprobs(logits, t):
    """TRL's fused head (``_ChunkedLogProbFunction``): fp32 logits times 1/T, full log_softmax."""
    return torch.log_softmax(logits * (1 / t)[:, None], -1)


def temperature_control(device, rows, vocab, logit_std, seed=9) -> int:
    """The two stock temperature formulas on the same rows (the engine axis): every row's full
    logprob row from ``engine_logprobs`` vs ``trainer_logprobs``, per-row temperatures in
    [0.5, 1.0), logits ~ N(0, logit_std) rounded to bf16 (a bf16 lm_head's output)."""
    g = torch.Generator().manual_seed(seed)
    x = _rand(g, "cpu", rows, vocab, scale=logit_std, dtype=torch.bfloat16).float().to(device)
    t = (0.5 + 0.5 * torch.rand(rows, generator=g)).to(device)
    eng, tr = engine_logprobs(x, t), trainer_logprobs(x, t)
    for i in range(rows):
        assert_bitwise_equal(tr[i], eng[i], f"row {i} (T = {float(t[i]):.4f}, logits ~ N(0, {logit_std}) "
                             f"x {vocab}): trainer x * (1/T) vs engine x / T")
    return rows


def stock_controls(device: str) -> list[Control]:
    """The stock controls for ``device`` ("cpu" or "cuda"); tensors are built when a control runs."""
    if device == "cpu":
        return [
            Control("control: F.linear fp32", "batch", lambda: linear_control("cpu", 256, 512, rows=32, max_batch=512)),
            Control("control: SDPA", "schedule", lambda: sdpa_control("cpu", (1, 23, 61), 4, 2, 64, False)),
            Control("control: x/T vs x*(1/T)", "engine (T per row)",
                    lambda: temperature_control("cpu", 32, 5000, 4.0)),
        ]
    bf = torch.bfloat16
    return [
        Control("control: F.linear fp32", "batch", lambda: linear_control(device, 256, 512, rows=32, max_batch=512)),
        Control("control: F.linear bf16 4096x4096", "batch (M 1 vs up to 4096)",
                lambda: linear_control(device, 4096, 4096, dtype=bf)),
        Control("control: F.linear bf16 4096x12288", "batch (M 1 vs up to 4096)",
                lambda: linear_control(device, 4096, 12288, dtype=bf)),
        Control("control: SDPA decode L=2048", "schedule (engine-style flash)",
                lambda: sdpa_control(device, (257, 2048), 32, 8, 128, True, block_sizes=(16, 64))),
        Control("control: x/T vs x*(1/T)", "engine (T per row)",
                lambda: temperature_control(device, 16, 151936, 4.0)),
    ]


def run_controls(device: str, controls=None) -> dict:
    """Run ``controls`` (default: ``stock_controls(device)``); {name: {axes, mismatch_found, cases or
    first_mismatch, seconds}} for a benchmark's JSON. Other errors propagate."""
    res = {}
    for c in controls if controls is not None else stock_controls(device):
        t0 = time.time()
        try:
            res[c.name] = {"axes": c.axes, "mismatch_found": False, "cases": c.run()}
        except BitMismatch as e:
            res[c.name] = {"axes": c.axes, "mismatch_found": True, "first_mismatch": str(e)[:600]}
        res[c.name]["seconds"] = round(time.time() - t0, 2)
    return res


__all__ = ["Control", "stock_controls", "run_controls", "linear_control", "sdpa_control", "temperature_control",
           "engine_logprobs", "trainer_logprobs"]
