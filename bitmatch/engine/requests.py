"""A request's inputs checked before the engine queues it: prompts as token ids, sampling params.

Every refusal is a ValueError naming the argument, the element and the fix, raised before anything
is queued (``Engine.generate`` / ``Engine.add_request``).
"""
from __future__ import annotations

import numbers

import numpy as np
import torch

from bitmatch.engine.sampling import SamplingParams


def describe(x) -> str:
    """What a value is, for a message: the type, and a tensor's or array's shape and dtype."""
    if isinstance(x, (torch.Tensor, np.ndarray)):
        return f"{type(x).__name__} of shape {tuple(x.shape)}, dtype {x.dtype}"
    return f"{type(x).__name__} {x!r}" if isinstance(x, (bool, float, int, str, np.generic)) else type(x).__name__


def token_ids(prompt, where: str) -> list[int]:
    """A prompt as a list of Python ints, or ValueError naming ``where``, the element and the fix.
    1-D tensors / arrays and numpy integers are taken as token ids; floats and bools never are."""
    if isinstance(prompt, (torch.Tensor, np.ndarray)):
        if prompt.ndim != 1:
            raise ValueError(f"{where} must be one prompt's token ids (1-D), got {describe(prompt)}; for a batch pass "
                             "a list of token-id lists, one per prompt, without padding (e.g. [row[m.bool()].tolist() "
                             "for row, m in zip(ids, mask)])")
        if prompt.dtype in (torch.bool, np.bool_) or torch.is_tensor(prompt) and prompt.is_floating_point() or \
                isinstance(prompt, np.ndarray) and prompt.dtype.kind not in "iu":
            raise ValueError(f"{where} must hold integer token ids, got {describe(prompt)}; pass prompt.long() / "
                             "the tokenizer's ids")
        return [int(t) for t in prompt.tolist()]
    if not isinstance(prompt, (list, tuple)):
        raise ValueError(f"{where} must be a list of token ids or a string, got {describe(prompt)}")
    for j, t in enumerate(prompt):
        if isinstance(t, (bool, np.bool_)) or not isinstance(t, numbers.Integral):
            hint = " (a batch of prompts? pass it as the list of prompts, not as one prompt)" \
                if isinstance(t, (list, tuple, torch.Tensor, np.ndarray)) else ""
            raise ValueError(f"{where}[{j}] must be an int token id, got {describe(t)}{hint}")
    return [int(t) for t in prompt]


def check_sampling_params(sp, where: str) -> None:
    """``sp`` is a SamplingParams, or a ValueError naming ``where`` (and, for a dict, the fix)."""
    if not isinstance(sp, SamplingParams):
        fix = f" (pass SamplingParams(**{sp!r}))" if isinstance(sp, dict) else ""
        raise ValueError(f"{where} must be a bitmatch.SamplingParams, got {describe(sp)}{fix}")


def batch_requests(prompts, sampling_params) -> tuple[list, list[SamplingParams]]:
    """``Engine.generate``'s arguments as (prompts, one SamplingParams per prompt): one prompt (a string, a
    1-D tensor / array, a list of ints) becomes a batch of one; ``sampling_params`` is None, one
    SamplingParams for every prompt, or a list of one per prompt."""
    if isinstance(prompts, (torch.Tensor, np.ndarray)) and prompts.ndim != 1:
        raise ValueError(f"Engine.generate: prompts must be a list of prompts (token-id lists or strings) or one "
                         f"prompt, got {describe(prompts)}; pass a list of token-id lists, one per prompt, without "
                         "padding (e.g. [row[m.bool()].tolist() for row, m in zip(ids, mask)])")
    if isinstance(prompts, (str, torch.Tensor, np.ndarray)) or (
            isinstance(prompts, (list, tuple)) and prompts and not isinstance(prompts[0], (
                str, list, tuple, torch.Tensor, np.ndarray))):
        prompts = [prompts]  # one prompt (its elements are checked as token ids)
    if not isinstance(prompts, (list, tuple)):
        raise ValueError(f"Engine.generate: prompts must be a list of prompts (token-id lists or strings) or "
                         f"one prompt, got {describe(prompts)}")
    prompts = list(prompts)
    if sampling_params is None or isinstance(sampling_params, SamplingParams):
        params = [sampling_params or SamplingParams()] * len(prompts)
    elif isinstance(sampling_params, (list, tuple)):
        params = list(sampling_params)
        if len(params) != len(prompts):
            raise ValueError(f"Engine.generate: sampling_params has {len(params)} entries for "
                             f"{len(prompts)} prompts")
        for i, sp in enumerate(params):
            check_sampling_params(sp, f"Engine.generate: sampling_params[{i}]")
    else:
        check_sampling_params(sampling_params, "Engine.generate: sampling_params (one, or a list of one per "
                              "prompt)")
    return prompts, params
