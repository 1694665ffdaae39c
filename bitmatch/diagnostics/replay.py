"""Replay a repro bundle (what the TRL / verl step check writes on a mismatch) against a model.

A bundle folder holds ``config.json`` (step, temperature, top-k / top-p, compute dtype, the rollout
weights' fingerprint, the first divergence) and ``tokens.pt`` (the step's token ids and masks, the
rollout's and the trainer's logprobs); no weights. ``replay`` rescores the tokens with
``bitmatch.token_logprobs`` on the given model, compares the result with the rollout's logprobs as
fp32 bit patterns, and on a difference runs ``bitmatch.diagnostics.verify.locate`` (trainer's packed forward vs
the engine's paged one) on the first divergent sequence up to its divergent token.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch

import bitmatch
from bitmatch.diagnostics.stepcheck import weights_fingerprint
from bitmatch.diagnostics.verify import CompareResult, LocateResult, compare, locate
from bitmatch.logprobs import token_logprobs
from bitmatch.models.lora import merged_state_dict

__all__ = ["Bundle", "ReplayResult", "read_bundle", "replay"]

# the two layouts the adapters write: TRL's prompt / completion halves, verl's whole rows + responses
TRL_KEYS = ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "rollout_logprobs", "trainer_logprobs")
VERL_KEYS = ("input_ids", "attention_mask", "responses", "response_mask", "rollout_logprobs", "trainer_logprobs")
DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float32": torch.float32, "fp32": torch.float32,
          "float16": torch.float16}


@dataclass
class Bundle:
    """A bundle's tokens as whole rows: ``ids`` / ``mask`` [B, L]; the last ``C`` positions are the
    completions, compared where ``completion_mask`` [B, C] is 1."""

    folder: str
    config: dict
    ids: torch.Tensor
    mask: torch.Tensor
    completion_mask: torch.Tensor
    rollout_logprobs: torch.Tensor
    trainer_logprobs: torch.Tensor
    temperature: float
    top_k: int | None
    top_p: float | None
    dtype: torch.dtype | None       # the step's compute dtype, when the bundle says

    @property
    def completion_len(self) -> int:
        return self.completion_mask.shape[1]


def _dtype(name) -> torch.dtype | None:
    if not name or name == "None":
        return None
    return DTYPES.get(str(name).removeprefix("torch."))


def read_bundle(folder: str) -> Bundle:
    """The bundle in ``folder``; ValueError naming the file, the problem and the fix otherwise."""
    folder = os.path.abspath(os.path.expanduser(folder))
    cfg_path, tok_path = os.path.join(folder, "config.json"), os.path.join(folder, "tokens.pt")
    if not os.path.isdir(folder):
        raise ValueError(f"replay: {folder!r} is not a folder; give a bundle folder (e.g. "
                         "<output_dir>/bitmatch_repro/step3_train_rank0)")
    for p in (cfg_path, tok_path):
        if not os.path.isfile(p):
            raise ValueError(f"replay: {folder!r} has no {os.path.basename(p)}: not a repro bundle "
                             "(a bundle holds config.json and tokens.pt)")
    try:
        with open(cfg_path) as f:
            cfg = json.load(f)
        t = torch.load(tok_path, map_location="cpu", weights_only=True)
    except Exception as e:  # any read failure is the bundle's: name the file
        raise ValueError(f"replay: cannot read the bundle in {folder!r} ({type(e).__name__}: {e})") from e
    if not isinstance(cfg, dict) or not isinstance(t, dict):
        raise ValueError(f"replay: {folder!r}: config.json must hold an object and tokens.pt a dict of tensors")
    if all(k in t for k in TRL_KEYS):
        cmask = t["completion_mask"]
        # attended: every completion token up to the row's last compared one (a tool mask may zero
        # tokens inside a completion: they are still in the sequence)
        attended = (cmask.flip(1).cumsum(1) > 0).flip(1).long()
        ids = torch.cat([t["prompt_ids"], t["completion_ids"]], 1)
        mask = torch.cat([t["prompt_mask"], attended], 1)
    elif all(k in t for k in VERL_KEYS):
        ids, mask, cmask = t["input_ids"], t["attention_mask"], t["response_mask"]
    else:
        raise ValueError(f"replay: tokens.pt in {folder!r} has keys {sorted(t)}, neither the TRL layout "
                         f"{list(TRL_KEYS)} nor verl's {list(VERL_KEYS)}")
    lp = t["rollout_logprobs"].float()
    if lp.shape != cmask.shape or t["trainer_logprobs"].shape != cmask.shape or ids.shape[1] < cmask.shape[1]:
        raise ValueError(f"replay: tokens.pt in {folder!r}: logprobs {tuple(lp.shape)} / "
                         f"{tuple(t['trainer_logprobs'].shape)} do not line up with the completion mask "
                         f"{tuple(cmask.shape)} (one logprob per completion token)")
    temperature = cfg.get("temperature")
    if not isinstance(temperature, (int, float)) or temperature <= 0:
        raise ValueError(f"replay: config.json in {folder!r} has temperature {temperature!r}: the step's "
                         "sampling temperature (> 0) is needed to rescore its tokens")
    dtype = _dtype(cfg.get("compute_dtype") or cfg.get("rollout_dtype"))
    return Bundle(folder, cfg, ids.long(), mask.long(), cmask, lp, t["trainer_logprobs"].float(),
                  float(temperature), cfg.get("top_k") or None, cfg.get("top_p"), dtype)


@dataclass
class ReplayResult:
    """The replay's verdict: ``rollout`` compares the rescored logprobs with the rollout's (the
    step's question), ``trainer`` with the trainer's (does this model reproduce the trainer side?)."""

    rollout: CompareResult
    trainer: CompareResult
    located: LocateResult | None
    fingerprint_matches: bool | None   # None: the bundle has no fingerprint, or it was not checked

    @property
    def bitmatched(self) -> bool:
        return self.rollout.bitmatched

    def summary(self) -> str:
        lines = [f"rescored vs rollout logprobs: {self.rollout.summary('rollout', 'rescored')}",
                 f"rescored vs trainer logprobs: {self.trainer.summary('trainer', 'rescored')}"]
        if self.fingerprint_matches is not None:
            lines.append("weights fingerprint: " + ("matches the bundle's" if self.fingerprint_matches else
                                                    "DIFFERS from the bundle's (not the step's weights)"))
        if self.located is not None:
            lines.append(f"locate (first divergent sequence): {self.located.summary()}")
            if self.located.bitmatched:
                lines.append("no op differs between the trainer's and the engine's forward on these tokens: "
                             "the difference came after the logits (sampler, logprob) or from the rollout's "
                             "weights (compare the weight version and fingerprint with the rollout's)")
        lines.append("verdict: " + ("rollout logprobs reproduced bit for bit" if self.bitmatched else
                                    "the rollout's logprobs DIFFER from this model's"))
        return "\n".join(lines)


def replay(bundle: Bundle, model, *, dtype: torch.dtype | None = None, block_size: int = 16,
           check_weights: bool = True) -> ReplayResult:
    """Rescore ``bundle``'s tokens on ``model`` (patched here at ``dtype``, default the bundle's
    compute dtype, else bf16) and compare with its rollout logprobs bit for bit; equal bits <=> the
    model reproduces the rollout's logprobs on these tokens. With ``check_weights`` a model whose
    weights fingerprint differs from the bundle's is refused (ValueError) before any rescoring."""
    dtype = dtype or bundle.dtype or torch.bfloat16
    want = bundle.config.get("weights_fingerprint")
    matches = None
    if want:
        # taken in the step's compute dtype (what the adapter fingerprinted), whatever ``dtype`` replays at
        matches = weights_fingerprint(merged_state_dict(model), bundle.dtype or dtype) == want
        if check_weights and not matches:
            version = bundle.config.get("weight_version")
            raise ValueError(
                "replay: the model's weights fingerprint differs from the bundle's: it is not the policy of step "
                f"{bundle.config.get('step')}" + (f" (weight version {version})" if version is not None else "")
                + "; give that step's checkpoint, or --any-weights to replay on these weights anyway")
    if not bitmatch.is_patched(model):
        bitmatch.patch(model, compute_dtype=dtype)
    dev = next(model.parameters()).device
    ids, mask = bundle.ids.to(dev), bundle.mask.to(dev)
    C = bundle.completion_len
    with torch.no_grad():
        lp = token_logprobs(model, ids, mask, temperature=bundle.temperature, top_k=bundle.top_k,
                            top_p=bundle.top_p, compute_dtype=dtype)[:, -C:].cpu()
    to_rollout = compare(bundle.rollout_logprobs, lp, bundle.completion_mask)
    to_trainer = compare(bundle.trainer_logprobs, lp, bundle.completion_mask)
    located = None
    if not to_rollout.bitmatched:
        s, j = to_rollout.first_divergence
        n = ids.shape[1] - C + j + 1     # the sequence up to its divergent token
        located = locate(model, model, ids[s:s + 1, :n], mask[s:s + 1, :n], compute_dtype_a=dtype,
                         compute_dtype_b=dtype, paged_b_block_size=block_size)
    return ReplayResult(to_rollout, to_trainer, located, matches)
