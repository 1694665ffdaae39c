"""The per-step proof on verl's own tensors: ``rollout_log_probs`` vs the actor's ``old_log_probs``.

verl's trainer (``RayPPOTrainer.fit``, decoupled mode: old logprobs recomputed by the actor)
imports ``verl.utils.debug.metrics.calculate_debug_metrics`` and calls it on the step's batch
whenever the rollout returned ``rollout_log_probs``, and merges what it returns into the step's
metric dict. ``install`` wraps that function: verl's ``training/rollout_probs_diff_*`` plus
``bitmatch/diff_max``, ``bitmatch/mismatch_tokens``, ``bitmatch/kl_k3``, ``bitmatch/compared_tokens``,
``bitmatch/compared_seqs``, from the shared ``bitmatch.diagnostics.stepcheck.StepChecker`` (bit
patterns of the same response tokens, a step with no response token compared is a failure; policy
raise / warn / log, the TRL adapter's message: step, sequence, token, both values in hex, first
divergent layer, repro bundle). ``check_batch`` is the same check for loops that drive the
workers themselves.

Policy and bundle folder: ``configure(on_mismatch=..., repro_dir=...)`` in the driver, or the
environment ``BITMATCH_ON_MISMATCH`` (raise | warn | log, default raise) and
``BITMATCH_REPRO_DIR`` (default ``./bitmatch_repro``).
"""
from __future__ import annotations

import functools
import os

import torch

from bitmatch import switch
from bitmatch.adapters.verl import require_plugin
from bitmatch.diagnostics.stepcheck import Divergence, StepCheck, StepChecker, locate_sentence, weights_sentence

_CHECKER: StepChecker | None = None
_ORIG_DEBUG = None
_ACTIVE = False     # this process runs a bitmatch rollout / replica (a stock verl run is left alone)


def activate():
    global _ACTIVE
    _ACTIVE = True


def active() -> bool:
    return _ACTIVE or _CHECKER is not None or switch.enabled()


def configure(on_mismatch: str | None = None, repro_dir: str | None = None, max_bundles: int = 3) -> StepChecker:
    """A fresh checker for this process (the history starts empty); turns the check on."""
    global _CHECKER
    _CHECKER = StepChecker(on_mismatch or os.environ.get("BITMATCH_ON_MISMATCH", "raise"),
                           repro_dir or os.environ.get("BITMATCH_REPRO_DIR", "bitmatch_repro"), max_bundles,
                           where="bitmatch verl")
    return _CHECKER


def checker() -> StepChecker:
    return _CHECKER if _CHECKER is not None else configure()


def _response_tensors(batch):
    b = batch.batch
    for key in ("rollout_log_probs", "old_log_probs", "responses"):
        if key not in b.keys():
            raise KeyError(f"bitmatch verl: the step's batch has no {key!r}; the check needs the rollout's "
                           "rollout_log_probs (rollout.calculate_log_probs=True) and the actor's old_log_probs")
    R = b["responses"].size(1)
    mask = b["response_mask"] if "response_mask" in b.keys() else b["attention_mask"][:, -R:]
    return b["rollout_log_probs"], b["old_log_probs"], mask


def check_batch(batch, step: int | None = None, mode: str = "train", log_metrics=None) -> StepCheck:
    """Compare the batch's ``rollout_log_probs`` with its ``old_log_probs`` (bits, response tokens)."""
    require_plugin()
    rollout_lp, actor_lp, mask = _response_tensors(batch)
    c = checker()
    if step is None:
        step = batch.meta_info.get("global_steps", len(c.history))
    reduce = None
    if torch.distributed.is_available() and torch.distributed.is_initialized() and batch.meta_info.get(
            "bitmatch_reduce", False):
        def reduce(stats):
            out = [torch.zeros_like(stats) for _ in range(torch.distributed.get_world_size())]
            torch.distributed.all_gather(out, stats)
            return torch.cat(out)
    return c.check(step=int(step), mode=mode, rollout=rollout_lp, trainer=actor_lp, mask=mask, reduce=reduce,
                   diagnose=functools.partial(_diagnose, batch, int(step)), log_metrics=log_metrics)


def _diagnose(batch, step, res) -> Divergence:
    b = batch.batch
    s, j = res.first_divergence
    R = b["responses"].size(1)
    P = b["input_ids"].size(1) - R
    upto = P + j + 1
    ids, am = b["input_ids"][s:s + 1, :upto], b["attention_mask"][s:s + 1, :upto]
    where, weights = _locate(ids, am)
    from bitmatch.adapters.verl.rollout import LIVE
    rollout = LIVE[-1] if LIVE else None
    cfg = {"weight_version": batch.meta_info.get("weight_version"),
           "temperature": getattr(getattr(rollout, "config", None), "temperature", None),
           "rollout_dtype": str(getattr(rollout, "dtype", None)), "framework": "verl"}
    tensors = {"input_ids": b["input_ids"], "attention_mask": b["attention_mask"], "responses": b["responses"],
               "response_mask": _response_tensors(batch)[2], "rollout_logprobs": b["rollout_log_probs"].float(),
               "trainer_logprobs": b["old_log_probs"].float()}
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    return Divergence(int(b["responses"][s, j]), where, weights, cfg, tensors, f"rank{rank}")


def _locate(ids, mask):
    """First divergent layer between the bitmatch rollout of this process and its worker's patched actor."""
    from bitmatch.adapters.verl.rollout import LIVE
    rollout = LIVE[-1] if LIVE else None
    actor = getattr(rollout, "actor_engine", None)
    if actor is None:
        why = ("the actor is not on bitmatch kernels" if rollout is not None else
               "no bitmatch rollout lives in this process, e.g. the driver of a Ray run")
        return (f"First divergent layer: not located ({why}; run bitmatch.diagnostics.verify.locate on the "
                "bundle's tokens against the two models).", "")
    weights = ""
    try:
        src, _ = actor.get_per_tensor_param()
        # per tensor in the copy's own storage dtype (fp32 routers / SSM decay stay fp32 there)
        weights = weights_sentence(rollout.copy.differing(list(src)))
    except Exception as e:  # the weight comparison is a hint; the layer sentence below still stands
        weights = f" (Rollout weights not compared: {e!r}.)"
    block = rollout.engine.block_size if rollout.engine is not None else None
    mod = actor.module
    fsdp_root = callable(getattr(mod, "unshard", None))   # FSDP2: the root unit unshards in its own forward
    with torch.no_grad():
        if fsdp_root:
            mod.unshard()
        try:
            where = locate_sentence(mod, rollout.model, ids, mask, compute_dtype=rollout.dtype, block_size=block)
        finally:
            if fsdp_root:
                mod.reshard()
    return where, weights


def _calculate_debug_metrics(data):
    """verl's debug metrics, then the bitmatch check's metrics (same dict, same step)."""
    out = dict(_ORIG_DEBUG(data))
    if active():
        check_batch(data, log_metrics=out.update)
    return out


def install():
    """Wrap ``verl.utils.debug.metrics.calculate_debug_metrics`` (once)."""
    global _ORIG_DEBUG
    import verl.utils.debug.metrics as m

    if getattr(m.calculate_debug_metrics, "_bitmatch", False):
        return
    _ORIG_DEBUG = m.calculate_debug_metrics
    wrapped = functools.wraps(_ORIG_DEBUG)(_calculate_debug_metrics)
    wrapped._bitmatch = True
    m.calculate_debug_metrics = wrapped
