"""The stock counterpart of every public op: the same signature, computed as HF, vLLM or plain torch
compute it (cuBLAS / BLAS matmuls, torch reductions, SDPA, fp32 softmax, float cumsums). One
definition per op, declared beside it in ``kernels/table.py``; faults (``locate --inject kernel:OP``),
the stock controls, the benchmarks' "same engine on stock ops" baseline and the testing helpers all
read these, through ``kernels.override`` or directly.

A stock op agrees with the bitmatch op to rounding, not to the bit: that is the point of a
control. None of them promises batch or schedule invariance; where the stock engines choose a
kernel by batch shape (one batched SDPA for an all-decode step), so does ``attention_paged`` here.

One file per group of op families: ``layers`` (linear, norms, activation, rotary), ``fp8``,
``attention``, ``sampling`` (logprobs too), ``moe``, ``deepseek_v4`` (compressed attention, compressor,
indexer, mHC), ``mamba``. Each op's stock formula is defined once, in this package: a copy of one
elsewhere is what the op table replaced.
"""
from __future__ import annotations

from ._common import F32 as F32
from .attention import (
    attention_decode,
    attention_paged,
    attention_prefill,
    sdpa_paged,
    sdpa_prefill,
    write_kv_cache,
)
from .deepseek_v4 import (
    compress_rows,
    compress_windows,
    hc_head,
    hc_post,
    hc_pre,
    indexer_select,
    indexer_topk,
    row_keys,
    sink_attention,
    sink_attention_rows,
    sink_attention_rows_fp32,
)
from .fp8 import fp8_linear, fp8_linear_master, quantize_fp8_groups
from .layers import (
    apply_rotary,
    apply_rotary_interleaved,
    fused_add_rms_norm,
    linear,
    rms_norm,
    rotary_cos_sin,
    silu_and_mul,
)
from .mamba import causal_conv1d, gated_rms_norm, mamba_chunk_scan
from .moe import moe_combine, moe_experts, moe_route, moe_scores
from .sampling import (
    apply_top_k_top_p,
    categorical_sample,
    full_logprobs,
    token_logprobs,
    top_k_top_p_mask,
    uniform_noise,
)

__all__ = ["linear", "quantize_fp8_groups", "fp8_linear", "fp8_linear_master",
           "rms_norm", "fused_add_rms_norm", "silu_and_mul", "rotary_cos_sin", "apply_rotary",
           "apply_rotary_interleaved", "sdpa_prefill", "sdpa_paged", "attention_prefill", "attention_paged",
           "attention_decode", "write_kv_cache", "full_logprobs", "token_logprobs", "top_k_top_p_mask",
           "apply_top_k_top_p", "categorical_sample", "uniform_noise", "moe_scores", "moe_route", "moe_experts",
           "moe_combine", "sink_attention", "sink_attention_rows", "compress_windows", "compress_rows", "indexer_topk",
           "indexer_select", "hc_pre",
           "hc_post", "hc_head", "causal_conv1d", "row_keys", "sink_attention_rows_fp32",
           "mamba_chunk_scan", "gated_rms_norm"]
