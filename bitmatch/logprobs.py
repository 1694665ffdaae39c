"""Trainer-side logprobs: the same forward, logits and log_softmax as the engine's."""
from __future__ import annotations

import numbers

import numpy as np
import torch
from torch.utils.checkpoint import checkpoint

import bitmatch.kernels as K
from bitmatch.context import ForwardContext
from bitmatch.kernels import check_on_device, host_readable
from bitmatch.models import (
    Packed,
    compute_dtype_of as default_compute_dtype,
    compute_logits,
    forward_hidden,
    patch_state,
    spec_of,
    unwrap_causal_lm,
)
from bitmatch.models.fp8_mode import check_model, check_quantization
from bitmatch.precision import SUPPORTED_COMPUTE_DTYPES, unsupported_dtype_message
from bitmatch.wrappers import runner_for

# fp32 logits elements per chunk (1 GiB): each chunk pays its own launches (the head GEMM, the
# logprob kernel, the checkpointed recompute and backward GEMMs); at 2**25 a TRL micro-batch of
# 64 x 50 tokens at vocab 151,936 ran 15 chunks and its fwd + bwd took 1.5x stock's time
DEFAULT_LOGIT_ELEMENTS = 1 << 28
# With autograd on, logits up to this many bytes (in the compute dtype, all chunks together) are kept
# for backward; beyond it each chunk is recomputed in backward (checkpointed). Keeping them saves one
# head GEMM and one logprob pass per chunk: the head is half the forward FLOPs of a model with few
# layers and a 150k vocabulary. Stock HF keeps its logits and an fp32 copy: several times this.
KEEP_LOGITS_BYTES = 4 << 30
# The kernels divide fp32 logits by T stored in fp32: below the smallest normal fp32 (2**-126) T's
# reciprocal overflows, so logits / T is +-inf (log_softmax NaN, the sampler's weights garbage);
# above the largest fp32 T is inf and -inf / T (a masked logit) is NaN.
F32_MIN_TEMPERATURE = float(torch.finfo(torch.float32).tiny)
F32_MAX_TEMPERATURE = float(torch.finfo(torch.float32).max)


def check_temperature(op: str, value, *, greedy_ok: bool = False, name: str = "temperature") -> float:
    """``value`` as a float after the checks every entry shares (``SamplingParams``,
    ``token_logprobs``): a real number, not a bool, 0 only where greedy decoding is meant
    (``greedy_ok``), otherwise a temperature whose fp32 value and reciprocal are finite and normal.
    The error names ``op``, the argument and the valid range."""
    greedy = "0 (greedy) or " if greedy_ok else ""
    valid = f"{greedy}a float in [{F32_MIN_TEMPERATURE:.8g}, {F32_MAX_TEMPERATURE:.8g}]"
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise ValueError(f"{op}: {name} must be {valid}, got {value!r} ({type(value).__name__})")
    try:
        t = float(value)
    except OverflowError:
        t = float("inf")
    if greedy_ok and t == 0.0:
        return 0.0
    if not t > 0:  # negative, NaN, or 0 where greedy is not meant
        raise ValueError(f"{op}: {name} must be {'>= 0' if greedy_ok else '> 0'}, got {value!r} (valid: {valid})")
    t32 = float(np.float32(t)) if t <= F32_MAX_TEMPERATURE else float("inf")
    if t32 < F32_MIN_TEMPERATURE:
        raise ValueError(f"{op}: {name} must be {valid}, got {value!r}: below the smallest normal float32 its "
                         "reciprocal overflows in float32, so logits / T is not finite (NaN logprobs, "
                         "out-of-vocabulary draws); use a larger temperature")
    if t32 > F32_MAX_TEMPERATURE:
        raise ValueError(f"{op}: {name} must be {valid}, got {value!r}: it is not finite in float32 (the kernels "
                         "store T in float32)")
    return t


def _chunk_logprobs(lm, dtype, temperature, top_k, top_p, hidden, targets, entropy=False):
    logits = compute_logits(lm, hidden, compute_dtype=dtype)
    # the engine's and the vLLM plugin's mask: -inf outside, so the log_softmax renormalizes
    logits = K.apply_top_k_top_p(logits, temperature, top_k, top_p)
    lp = K.token_logprobs(logits, targets, temperature)
    if not entropy:
        return lp
    # entropy of the same distribution (a metric / bonus: exact bits not required); masked
    # tokens contribute 0 (not 0 * -inf)
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    plogp = torch.where(torch.isfinite(logp), logp.exp() * logp, torch.zeros_like(logp))
    return lp, -plogp.sum(-1)


def _check_inputs(lm, input_ids, attention_mask, temperature, top_k, top_p):
    """Input errors named with their fix, before any forward (the trainer's first line of defence)."""
    op = "token_logprobs"
    if isinstance(temperature, torch.Tensor):
        if temperature.numel() != 1:
            raise ValueError(f"{op}: temperature must be a float (one temperature for the batch), got a tensor "
                             f"of shape {tuple(temperature.shape)}")
        if temperature.dtype == torch.bool:
            raise ValueError(f"{op}: temperature must be a float, got a bool tensor")
        temperature = float(temperature)
    if not isinstance(temperature, (bool, np.bool_)) and isinstance(temperature, numbers.Real) \
            and temperature == 0:
        raise ValueError(f"{op}: temperature=0 is greedy decoding, which has no distribution to score: greedy "
                         "rows are scored at T = 1 (as vLLM and bitmatch.Engine report them); pass temperature=1.0")
    temperature = check_temperature(op, temperature)
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < -1):
        raise ValueError(f"{op}: top_k must be an int >= 1 (or None / -1 / 0 for no top-k), got {top_k!r}")
    if top_p is not None and (isinstance(top_p, bool) or not isinstance(top_p, (int, float))
                              or not 0.0 < top_p <= 1.0):
        raise ValueError(f"{op}: top_p must be a float in (0, 1] (or None / 1.0 for no top-p), got {top_p!r}")
    if not isinstance(input_ids, torch.Tensor):
        raise ValueError(f"{op}: input_ids must be a torch.Tensor [batch, seq_len] of token ids, "
                         f"got {type(input_ids).__name__}")
    if input_ids.dim() != 2:
        hint = " (one sequence: pass input_ids.unsqueeze(0), and its mask likewise)" if input_ids.dim() == 1 else ""
        raise ValueError(f"{op}: input_ids must be 2-D [batch, seq_len], got shape {tuple(input_ids.shape)}{hint}")
    if input_ids.is_floating_point() or input_ids.is_complex() or input_ids.dtype == torch.bool:
        raise ValueError(f"{op}: input_ids must hold integer token ids (torch.long), got dtype {input_ids.dtype}; "
                         "pass input_ids.long() (the tokenizer's ids, not embeddings or probabilities)")
    if attention_mask is not None and (not isinstance(attention_mask, torch.Tensor)
                                       or attention_mask.shape != input_ids.shape):
        raise ValueError(f"{op}: attention_mask must be a tensor shaped like input_ids {tuple(input_ids.shape)}, "
                         f"got {tuple(getattr(attention_mask, 'shape', ())) or type(attention_mask).__name__}")
    if attention_mask is not None:
        _refuse_mask_holes(op, attention_mask)
    if host_readable(input_ids):  # else checked on the device once packed (check_token_ids)
        real = input_ids if attention_mask is None else input_ids[attention_mask != 0]
        lo, hi = (int(v) for v in torch.aminmax(real)) if real.numel() else (0, 0)
        if lo < 0 or hi >= lm.lm_head.weight.shape[0]:
            raise ValueError(_bad_ids(lm, f"got min {lo} max {hi}"))
    max_pos = getattr(lm.config, "max_position_embeddings", None)
    if max_pos is not None and input_ids.shape[1] > max_pos:
        lengths = input_ids.shape[1] if attention_mask is None else int((attention_mask != 0).sum(1).max())
        if lengths > max_pos:
            raise ValueError(f"{op}: a sequence has {lengths} tokens, more than the model's "
                             f"max_position_embeddings={max_pos}; truncate input_ids (or use a model configured "
                             "for longer contexts)")
    return temperature


def _bad_ids(lm, got: str) -> str:
    return (f"token_logprobs: input_ids must be token ids in [0, vocab_size={lm.lm_head.weight.shape[0]}) wherever "
            f"attention_mask is 1, {got}; mask out padding / label sentinels such as -100 with attention_mask, "
            "or check the tokenizer matches the model")


def _refuse_mask_holes(op: str, attention_mask: torch.Tensor) -> None:
    """Each row's ones must be one run (left and/or right padding): packing would drop a masked
    token in the middle and renumber the positions after it, which scores another sequence than
    HF does for the same mask."""
    # values first, in the one function that reads the mask on the host (tests/test_training_syncs.py)
    if attention_mask.is_complex() or not bool(((attention_mask == 0) | (attention_mask == 1)).all()):
        bad = attention_mask[(attention_mask != 0) & (attention_mask != 1)].flatten()[:1].tolist()
        raise ValueError(f"{op}: attention_mask must hold 0 (padding) and 1 (a real token) only, got {bad}; "
                         "pass (attention_mask != 0).long() if any nonzero value means a real token")
    m = attention_mask != 0
    L = m.shape[1]
    if L == 0:
        return
    cols = torch.arange(L, device=m.device)
    first = torch.where(m, cols, L).amin(1)
    last = torch.where(m, cols, -1).amax(1)
    holes = (m.sum(1) > 0) & (last - first + 1 != m.sum(1))
    if bool(holes.any()):
        r = int(holes.nonzero()[0])
        c = int(first[r]) + int((~m[r, int(first[r]):]).nonzero()[0])
        raise ValueError(f"{op}: attention_mask row {r} has a 0 at column {c} between 1s; only left or right padding "
                         "is supported (a hole would be scored as if the token were deleted, positions renumbered, "
                         "not as HF scores that mask): drop the token from input_ids, or keep it in the mask and "
                         "leave its logprob out of the loss")


def pack_rows(input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> tuple[Packed, int]:
    """``bitmatch.models.pack(input_ids, attention_mask)`` (one sequence per row with real tokens)
    and its longest sequence, with the layout built as host metadata: from the shape alone without
    a mask (no host read at all), else from the mask on the host (free for a CPU mask; a device
    mask is copied back once), where pack's device path reads back its ``nonzero`` and its
    sequence count. Same tensors as pack (tests/test_training_syncs.py)."""
    B, L = input_ids.shape
    dev = input_ids.device
    if attention_mask is None:
        rows = torch.arange(B, device=dev).repeat_interleave(L)
        cols = torch.arange(L, device=dev).repeat(B)
        cu = torch.arange(B + 1 if L else 1, device=dev, dtype=torch.int32) * L
        return Packed(input_ids.reshape(-1).to(torch.long), cols, cu, rows, cols, cols == 0, cols == L - 1,
                      tuple(range(0, B * L + 1, L)) if L else (0,)), L
    m = attention_mask.detach().to("cpu") != 0
    rows, cols = m.nonzero(as_tuple=True)
    lengths = m.sum(1)
    lengths = lengths[lengths > 0]
    cu = torch.zeros(lengths.numel() + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(lengths, 0)
    seq_id = torch.repeat_interleave(torch.arange(lengths.numel()), lengths, output_size=rows.numel())
    positions = torch.arange(rows.numel()) - cu[:-1].to(torch.long)[seq_id]
    end = torch.zeros(rows.numel(), dtype=torch.bool)
    end[(cu[1:] - 1).to(torch.long)] = True
    longest = int(lengths.max()) if lengths.numel() else 0

    def put(t):  # host -> device without a stream sync (pageable memory is staged at the call)
        return t.to(dev, non_blocking=True)
    rows, cols = put(rows), put(cols)
    return Packed(input_ids[rows, cols].to(torch.long), put(positions), put(cu), rows, cols, put(positions == 0),
                  put(end), tuple(cu.tolist())), longest


def token_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                   temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None,
                   chunk_rows: int | None = None, compute_dtype: torch.dtype | None = None,
                   return_entropy: bool = False, recompute_logits: bool | None = None,
                   quantization: str | None = None):
    """fp32 [B, L-1]: logprob of ``input_ids[:, 1:]`` given its prefix (0 where the token is padding
    or the first real token of its row), ``log_softmax(logits.float() / T)`` over the full
    vocabulary, or, with ``top_k`` / ``top_p``, over the tokens ``kernels.top_k_top_p_mask`` keeps
    (the renormalized distribution the engine and the vLLM plugin sample from and report as
    ``sampled_logprobs`` / ``processed_logprobs``); gradients flow through the kept logits.

    Left or right padding (both at once too); a 0 between 1s in a row of ``attention_mask`` is
    refused (ValueError naming the row and column); ``attention_mask`` holds 0 and 1 only. The
    real tokens are packed (positions from 0 at the first real token) and run through
    ``bitmatch.models.forward_hidden``; logits are computed over row chunks of about 2**28 logits
    (``chunk_rows`` rows where no gradient is recorded: under autograd the chunks are always the
    default ones, whose partition fixes the gradient bits). With autograd on, the logits are kept
    for backward while all of them fit in ``KEEP_LOGITS_BYTES`` (4 GiB), and beyond that
    recomputed in backward chunk by chunk (checkpointed), so the whole [B, L, V] never exists;
    ``recompute_logits`` True / False forces either. The bits of the logprobs and of their
    gradients depend on neither ``chunk_rows`` nor ``recompute_logits``. ``return_entropy``: also
    return the fp32 [B, L-1] entropy of the same distribution at the same positions (with
    gradients): ``(logprobs, entropy)``.
    An FSDP2 model (``fully_shard`` on the root and, after ``bitmatch.patch``, on whole decoder
    layers) runs inside FSDP2's own forward hooks (``bitmatch.parallel.fsdp``, found through
    ``bitmatch.wrappers``): the same bits on every rank, gradients reduce-scattered into the shards
    as FSDP2's own forward has them; a ``DistributedDataParallel`` model inside DDP's own forward
    (``bitmatch.parallel.ddp``), so the backward all-reduces the gradients as DDP's forward has it.
    ``quantization="fp8"``: every projection linear (q/k/v/o, gate/up/down) runs block-FP8 W8A8 on the
    master weights cast to the compute dtype and quantized by ``quantize_fp8_blocks`` (the bytes the
    engine runs), gradients straight through to the master weights; the embeddings, the LM head and
    MoE experts stay in the compute dtype (docs/fp8.md, "FP8 mode"). Default: the one set by
    ``bitmatch.patch(model, quantization=...)``, else None.
    Invariance: each token's value depends only on its own row's tokens, T, k and p.
    """
    args = (input_ids, attention_mask, temperature, top_k, top_p, chunk_rows, compute_dtype, return_entropy,
            recompute_logits, quantization)
    run = runner_for(model)  # DDP's or FSDP2's handler (bitmatch.parallel), declared in bitmatch/__init__.py
    return run(_token_logprobs, *args) if run is not None else _token_logprobs(model, *args)


def _token_logprobs(model, input_ids, attention_mask, temperature, top_k, top_p, chunk_rows, compute_dtype,
                    return_entropy, recompute_logits=None, quantization=None):
    if chunk_rows is not None and chunk_rows < 1:
        raise ValueError(f"token_logprobs: chunk_rows must be >= 1, got {chunk_rows}")
    if recompute_logits not in (None, True, False):
        raise ValueError(f"token_logprobs: recompute_logits must be None (by size), True or False, "
                         f"got {recompute_logits!r}")
    lm = unwrap_causal_lm(model)
    if isinstance(attention_mask, torch.Tensor):
        # the packed layout is host metadata: a device mask costs the step's one host read here,
        # a CPU mask none (every check and pack below then reads the host copy)
        attention_mask = attention_mask.detach().to("cpu")
    temperature = _check_inputs(lm, input_ids, attention_mask, temperature, top_k, top_p)
    if quantization is None:
        st = patch_state(lm)
        quantization = None if st is None else st.quantization
    check_model(lm, spec_of(lm)[0], check_quantization(quantization, "token_logprobs"), "token_logprobs")
    # -1 / 0: no top-k (vLLM's values); k >= V keeps every token (the kernel's rule), and a k beyond
    # int64 (2**63) must not reach its int64 tensor
    top_k = top_k if top_k is not None and 0 < top_k < lm.lm_head.weight.shape[0] else None
    top_p = top_p if top_p is not None and top_p < 1.0 else None
    dtype = compute_dtype if compute_dtype is not None else default_compute_dtype(lm)
    if dtype not in SUPPORTED_COMPUTE_DTYPES:  # named here, not by the first norm that meets it
        raise ValueError(unsupported_dtype_message("token_logprobs", dtype,
                                                   "pass token_logprobs(..., compute_dtype=torch.bfloat16)"))
    dev = lm.lm_head.weight.device
    # host -> device without a stream sync (pageable memory is staged at the call); the mask stays
    # on the host (pack_rows reads its layout there)
    input_ids = input_ids.to(dev, non_blocking=True)
    B, L = input_ids.shape
    p, longest = pack_rows(input_ids, attention_mask)
    out = torch.zeros((B, max(L - 1, 0)), dtype=torch.float32, device=dev)
    empty = (out, torch.zeros_like(out)) if return_entropy else out
    if p.input_ids.numel() == 0:
        return empty
    V = lm.lm_head.weight.shape[0]
    if not host_readable(p.input_ids):
        check_on_device(((p.input_ids >= 0) & (p.input_ids < V)).all(), _bad_ids(lm, "got one outside"))
    # the host's longest sequence sizes attention's grid and bounds rope's table: nothing read back
    ctx = ForwardContext(positions=p.positions, cu_seqlens=p.cu_seqlens, max_query_len=longest,
                         max_seq_len=longest, cu_seqlens_host=p.cu_host, quantization=quantization)
    hidden = forward_hidden(lm, p.input_ids, ctx, compute_dtype=dtype)
    # the tokens that predict a next one: all but each sequence's last, counted from the shapes
    n_src = p.input_ids.shape[0] - (p.cu_seqlens.shape[0] - 1)
    if n_src == 0:
        return empty
    src = torch.nonzero_static(~p.seq_end, size=n_src)[:, 0]
    tgt = src + 1
    targets = p.input_ids[tgt]
    h = hidden[src]
    rows = max(1, DEFAULT_LOGIT_ELEMENTS // V)
    if chunk_rows is not None and not torch.is_grad_enabled():
        # under autograd the chunks stay the fixed ones above: the head's backward runs the stock
        # GEMMs per chunk (not row-invariant) and sums the head weight's gradient chunk by chunk,
        # so other chunks would give other gradient bits
        rows = chunk_rows
    if recompute_logits is None:
        recompute_logits = n_src * V * dtype.itemsize > KEEP_LOGITS_BYTES
    pieces = []
    for a in range(0, h.shape[0], rows):
        hc, tc = h[a:a + rows], targets[a:a + rows]
        if recompute_logits and torch.is_grad_enabled() and hc.requires_grad:
            pieces.append(checkpoint(_chunk_logprobs, lm, dtype, temperature, top_k, top_p, hc, tc, return_entropy,
                                     use_reentrant=False))
        else:
            pieces.append(_chunk_logprobs(lm, dtype, temperature, top_k, top_p, hc, tc, return_entropy))
    at = (p.rows[tgt], p.cols[tgt] - 1)
    if not return_entropy:
        lp = torch.cat(pieces) if len(pieces) > 1 else pieces[0]
        _refuse_nan(lp, temperature)
        return out.index_put(at, lp.to(torch.float32))
    lp = torch.cat([x[0] for x in pieces])
    _refuse_nan(lp, temperature)
    ent = torch.cat([x[1] for x in pieces])
    return out.index_put(at, lp.to(torch.float32)), torch.zeros_like(out).index_put(at, ent.to(torch.float32))


def _refuse_nan(lp: torch.Tensor, temperature: float) -> None:
    # NaN comes only from a non-finite scaled logit (+inf / T overflow, or NaN in the logits): the
    # engine refuses the same rows, so a NaN never reaches a loss or a comparison as a number
    if not host_readable(lp):
        check_on_device(~torch.isnan(lp.detach()).any(),
                        f"token_logprobs: NaN logprobs: the logits divided by temperature={temperature!r} are not "
                        "finite in float32")
        return
    bad = int(torch.isnan(lp.detach()).sum())
    if bad:
        raise ValueError(f"token_logprobs: {bad} of {lp.numel()} logprobs are NaN: the logits divided by "
                         f"temperature={temperature!r} are not finite in float32; raise the temperature, or, if "
                         "the model's logits are NaN at temperature=1.0 too, check its weights")
