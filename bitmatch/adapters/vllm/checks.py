"""What the bitmatch vLLM plugin supports, checked before anything runs.

Two gates, both raising an error that names every unsupported setting at once:
``check_engine_config`` when the engine is configured (main process, and again in each worker
when the model is built), ``unsupported_request_options`` when a request is admitted. Anything
that changes the reported logprob and that the plugin does not reproduce is refused here rather
than reported with other bits (docs/design.md section 6: reproduce or refuse, never hide).
"""
from __future__ import annotations

import importlib.util

import torch

from bitmatch.models import families, family_for_architecture
from bitmatch.models.registry import find_family


def vllm_architectures() -> tuple[str, ...]:
    """The registered families' architectures whose vLLM path is built and tested."""
    return tuple(a for f in families() if f.vllm_supported for a in f.architectures)

# processed_logprobs is what TRL and verl request; raw_logprobs is the same definition at T = 1
SUPPORTED_LOGPROBS_MODES = ("processed_logprobs", "raw_logprobs")
SUPPORTED_DTYPES = (torch.bfloat16, torch.float32)


class BitmatchUnsupportedError(ValueError):
    """An engine or request setting the bitmatch vLLM plugin cannot run bit for bit."""


def _engine_problems(vllm_config) -> list[str]:
    mc = vllm_config.model_config
    pc = vllm_config.parallel_config
    out = []
    archs = list(getattr(mc.hf_config, "architectures", None) or [])
    supported = vllm_architectures()
    if not archs or archs[0] not in supported:
        why = ""
        if archs:
            fam = find_family(archs[0])
            if fam is not None:  # bitmatch runs it in its own engine and trainer, not inside vLLM
                why = (f": bitmatch's vLLM plugin does not run the {fam.name or archs[0]} family ({fam.vllm_refusal}); "
                       "use bitmatch.Engine for its rollouts")
        out.append(f"architecture {archs[0] if archs else None!r}{why} (supported: {', '.join(supported)})")
    else:
        out += family_for_architecture(archs[0]).problems(mc.hf_config)
    out += _head_size_problems(mc.hf_config)
    if mc.quantization is not None or getattr(vllm_config, "quant_config", None) is not None:
        out.append(f"quantization={mc.quantization!r} (the plugin runs unquantized bf16/fp32 weights; FP8 runs in "
                   "bitmatch's own Engine(model, quantization='fp8'): docs/fp8.md, FP8 mode)")
    if vllm_config.speculative_config is not None:
        out.append("speculative decoding (speculative_config is set)")
    if mc.logprobs_mode not in SUPPORTED_LOGPROBS_MODES:
        out.append(f"logprobs_mode={mc.logprobs_mode!r} (supported: {', '.join(SUPPORTED_LOGPROBS_MODES)})")
    if mc.dtype not in SUPPORTED_DTYPES:
        out.append(f"dtype={mc.dtype} (supported: bfloat16, float32)")
    if pc.tensor_parallel_size != 1:
        out.append(f"tensor_parallel_size={pc.tensor_parallel_size} (vLLM loads o_proj / down_proj split over K for "
                   "an all-reduce, which changes the bits; bitmatch's TP layout needs their output rows with "
                   "the full K: run tensor parallel on the embedded engine, bitmatch.parallel.enable_tensor_parallel)")
    if pc.pipeline_parallel_size != 1:
        out.append(f"pipeline_parallel_size={pc.pipeline_parallel_size}")
    if vllm_config.lora_config is not None:
        out.append("enable_lora (vLLM applies LoRA inside its own linear kernels; merge adapters before "
                   "syncing weights, as TRL does)")
    kv_dtype = vllm_config.cache_config.cache_dtype
    if kv_dtype not in ("auto", None):
        out.append(f"kv_cache_dtype={kv_dtype!r} (the KV cache must hold the model dtype: use 'auto')")
    if getattr(vllm_config, "use_v2_model_runner", False) and not _v2_hooked():
        out.append("the V2 model runner (VLLM_USE_V2_MODEL_RUNNER=1): this vLLM has no V2 sampler the plugin can "
                   "hook (bitmatch/adapters/vllm/sampler_v2.py); use VLLM_USE_V2_MODEL_RUNNER=0")
    if getattr(mc, "return_sampling_mask", False):
        out.append("return_sampling_mask")
    return out


def _v2_hooked() -> bool:
    """Whether this vLLM ships the V2 runner's sampler that ``register`` hooks (``sampler_v2.py``)."""
    return importlib.util.find_spec("vllm.v1.worker.gpu.sample.sampler") is not None


def _head_size_problems(hf_config) -> list[str]:
    """vLLM's attention backend still sizes and lays out the paged KV cache (bitmatch only replaces the
    forward): on CPU its one backend accepts the listed head sizes and does not check at start, so a
    head_dim-16 model started and vLLM died at the first generate. On GPU vLLM's own selector refuses."""
    from vllm.platforms import current_platform
    if not current_platform.is_cpu():
        return []
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
    heads = getattr(hf_config, "num_attention_heads", None)
    d = getattr(hf_config, "head_dim", None) or (hf_config.hidden_size // heads if heads else None)
    if d is None or CPUAttentionBackend.supports_head_size(d):
        return []
    sizes = ", ".join(map(str, CPUAttentionBackend.get_supported_head_sizes()))
    return [f"head_dim={d} (vLLM's CPU attention backend, which lays out the KV cache, supports head sizes {sizes}; "
            "use bitmatch.Engine for this model's rollouts)"]


def check_engine_config(vllm_config) -> None:
    """Raise BitmatchUnsupportedError naming every unsupported engine setting (no silent fallback)."""
    problems = _engine_problems(vllm_config)
    if problems:
        raise BitmatchUnsupportedError(
            "bitmatch vLLM plugin is enabled (BITMATCH=1) but this engine configuration is unsupported: "
            + "; ".join(problems) + ". Change the setting or run without the plugin (unset BITMATCH).")


def unsupported_request_options(params, logprobs_mode: str) -> list[str]:
    """Names of the request's sampling options that would make the reported logprob differ from
    ``bitmatch.token_logprobs``: min-p, penalties, bias and token bans reshape the processed
    distribution, and a grammar bitmask changes the logits before either mode sees them. top-k
    and top-p are supported: the sampler draws from bitmatch's mask (``kernels.top_k_top_p_mask``)
    and reports its logprob, ``token_logprobs(..., top_k=, top_p=)`` on the trainer."""
    out = []
    if getattr(params, "structured_outputs", None) is not None:
        out.append("structured_outputs (the grammar mask changes the logits)")
    if logprobs_mode == "processed_logprobs":
        if params.min_p:
            out.append(f"min_p={params.min_p}")
        if params.presence_penalty:
            out.append(f"presence_penalty={params.presence_penalty}")
        if params.frequency_penalty:
            out.append(f"frequency_penalty={params.frequency_penalty}")
        if params.repetition_penalty not in (None, 1.0):
            out.append(f"repetition_penalty={params.repetition_penalty}")
        if params.logit_bias:
            out.append("logit_bias")
        if params.allowed_token_ids:
            out.append("allowed_token_ids")
        if params.bad_words:
            out.append("bad_words")
        if params.min_tokens:
            out.append(f"min_tokens={params.min_tokens} (masks the stop tokens)")
    return out


def check_request(params, logprobs_mode: str) -> None:
    bad = unsupported_request_options(params, logprobs_mode)
    if bad:
        raise BitmatchUnsupportedError(
            f"bitmatch vLLM plugin: unsupported sampling option(s) with logprobs_mode={logprobs_mode!r}: "
            + ", ".join(bad) + ". The trainer's logprob is log_softmax(logits / T) over the full vocabulary or "
            "over bitmatch's top-k / top-p mask; these options change the distribution vLLM reports "
            "(docs/design.md section 6).")
