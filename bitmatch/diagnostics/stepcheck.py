"""The per-step proof of an RL loop: rollout vs trainer logprobs of the same tokens. The TRL and
verl adapters run it; a custom training loop imports it the same way::

    from bitmatch.diagnostics.stepcheck import StepChecker
    checker = StepChecker(on_mismatch="raise", repro_dir="bitmatch-repro")
    check = checker.check(step=step, mode="train", rollout=rollout_lp, trainer=trainer_lp, mask=completion_mask)

One ``StepChecker`` per run compares the two logprob tensors of a generation step as fp32 bit
patterns (``bitmatch.diagnostics.verify.compare``), keeps a ``StepCheck`` per step in ``history``, hands the
``bitmatch/diff_max``, ``bitmatch/mismatch_tokens``, ``bitmatch/kl_k3`` metrics to the framework's
logger with ``bitmatch/compared_tokens`` and ``bitmatch/compared_seqs`` (so "0 mismatches" never
stands for "nothing checked"), and on any difference, or a step where nothing was compared, applies
the policy (``raise`` / ``warn`` / ``log``) with one message format: step, first divergent sequence
and token, both values in hex, the first divergent layer (``bitmatch.diagnostics.verify.locate``, through
``locate_sentence``) and the path of a small repro bundle. A caller supplies only its glue: where
the tensors live, how to gather across ranks, how to locate (which two models), and what goes
into the bundle's config.
"""
from __future__ import annotations

import json
import logging
import os
import warnings
from dataclasses import dataclass, field

import torch

import bitmatch
from bitmatch.diagnostics.verify import compare, locate
from bitmatch.models import unwrap_causal_lm
from bitmatch.sync import fingerprints

logger = logging.getLogger("bitmatch.stepcheck")  # the log channel, as "bitmatch.trl": kept from 0.1

ON_MISMATCH = ("raise", "warn", "log")
METRIC_KEYS = ("bitmatch/diff_max", "bitmatch/mismatch_tokens", "bitmatch/kl_k3", "bitmatch/compared_tokens",
               "bitmatch/compared_seqs")

__all__ = ["BitmatchMismatchError", "NothingComparedError", "StepCheck", "StepChecker", "Divergence", "ON_MISMATCH",
           "METRIC_KEYS",
           "check_policy", "locate_sentence", "weights_sentence", "weights_fingerprint",
           "versions", "write_bundle"]


class BitmatchMismatchError(AssertionError):
    """A rollout logprob differs from the trainer's for the same token (the run is off-policy)."""


class NothingComparedError(BitmatchMismatchError):
    """A generation step compared no token on any process: nothing proves it on-policy."""


def check_policy(on_mismatch: str, where: str = "attach") -> str:
    if on_mismatch not in ON_MISMATCH:
        raise ValueError(f"{where}: on_mismatch must be one of {ON_MISMATCH}, got {on_mismatch!r}")
    return on_mismatch


class StepCheck:
    """The comparison of one generation step (what ``StepChecker.history`` keeps)."""

    __slots__ = ("step", "mode", "total", "seqs", "mismatches", "diff_max", "kl_k3", "bundle", "message")

    def __init__(self, step, mode, total, mismatches, diff_max, kl_k3, bundle=None, message=None, seqs=0):
        self.step, self.mode, self.total, self.seqs, self.mismatches = step, mode, total, seqs, mismatches
        self.diff_max, self.kl_k3, self.bundle, self.message = diff_max, kl_k3, bundle, message

    @property
    def bitmatched(self) -> bool:
        """Compared at least one token, and every compared token's bits are equal."""
        return self.mismatches == 0 and self.total > 0

    def metrics(self) -> dict[str, float]:
        return dict(zip(METRIC_KEYS, (self.diff_max, float(self.mismatches), self.kl_k3, float(self.total),
                                      float(self.seqs))))

    def __repr__(self):
        return (f"StepCheck(step={self.step}, mode={self.mode!r}, tokens={self.total}, seqs={self.seqs}, "
                f"mismatches={self.mismatches}, diff_max={self.diff_max:.3g}, kl_k3={self.kl_k3:.3g})")


@dataclass
class Divergence:
    """What an adapter knows about the first divergent token (returned by its ``diagnose``)."""

    token_id: int
    where: str                              # "First divergent layer: ..." (locate_sentence)
    weights: str = ""                       # " Rollout weights differ ..." or ""
    config: dict = field(default_factory=dict)    # adapter's fields for the bundle's config.json
    tensors: dict = field(default_factory=dict)   # tokens.pt: ids, masks, both logprob tensors
    tag: str = "rank0"                      # bundle folder suffix (rank, ...)


class StepChecker:
    """Compare, record, report, apply the policy; one per training run."""

    def __init__(self, on_mismatch: str, repro_dir: str, max_bundles: int = 3, where: str = "attach"):
        self.on_mismatch = check_policy(on_mismatch, where)
        self.repro_dir = repro_dir
        self.max_bundles = max_bundles
        self.history: list[StepCheck] = []
        self._bundles = 0

    def check(self, *, step: int, mode: str, rollout, trainer, mask, reduce=None, diagnose=None,
              log_metrics=None) -> StepCheck:
        """rollout / trainer: [B, T] logprobs of the same tokens; mask: which to compare.
        reduce(stats [1, 5] float64 = max|diff|, mismatches, k3*n, n, sequences) -> [R, 5] gathers other
        ranks; diagnose(CompareResult) -> Divergence for this rank's first divergent token;
        log_metrics(dict) records the bitmatch/* metrics (called before the policy may raise).
        A step that compares no token on any rank is a failure too (``NothingComparedError`` under
        "raise"): a zero mismatch count must mean "checked and equal"."""
        res = compare(rollout.float(), trainer.float(), mask)
        stats = torch.tensor([[res.max_abs_diff, res.mismatches, res.k3_kl * res.total, res.total,
                               _compared_seqs(rollout, mask)]], dtype=torch.float64)
        g = (reduce(stats) if reduce is not None else stats).reshape(-1, 5).double().cpu()
        total = int(g[:, 3].sum())
        check = StepCheck(step=step, mode=mode, total=total, mismatches=int(g[:, 1].sum()),
                          diff_max=float(g[:, 0].max()), kl_k3=float(g[:, 2].sum()) / max(total, 1),
                          seqs=int(g[:, 4].sum()))
        self.history.append(check)
        if log_metrics is not None:
            log_metrics(check.metrics())
        if total == 0:
            ranks = f" on any of {g.shape[0]} processes" if g.shape[0] > 1 else ""
            check.message = (
                f"bitmatch: step {check.step} ({check.mode}) compared no token{ranks}: the mask selects none of "
                f"the {tuple(rollout.shape)} rollout logprobs (every completion empty or masked out, e.g. by a "
                "tool mask), so nothing proves this step on-policy; a zero mismatch count here would mean "
                "'nothing checked', not 'equal'.")
            self.apply_policy(check, NothingComparedError)
        elif res.mismatches:
            d = diagnose(res) if diagnose is not None else Divergence(-1, "First divergent layer: not located.")
            check.bundle = self._save_bundle(check, res, d)
            s, j = res.first_divergence
            check.message = (
                f"bitmatch: rollout and trainer logprobs differ at step {check.step} ({check.mode}): "
                f"{check.mismatches} of {check.total} completion tokens, max |diff| {check.diff_max:.3g}, "
                f"k3 KL {check.kl_k3:.3g}. First divergence: sequence {s}, completion token {j} (token id "
                f"{d.token_id}): rollout {res.first_rollout_value!r} ({res.first_rollout_hex}) vs trainer "
                f"{res.first_trainer_value!r} ({res.first_trainer_hex}). {d.where}{d.weights}"
                f" Repro bundle: {check.bundle if check.bundle else '(not saved: max_bundles reached)'}")
            self.apply_policy(check)
        elif check.mismatches:  # another rank found it (and reports it in full)
            check.message = f"bitmatch: step {check.step}: {check.mismatches} mismatching tokens on another process"
            self.apply_policy(check)
        return check

    def apply_policy(self, check: StepCheck, error: type[BitmatchMismatchError] = BitmatchMismatchError):
        if self.on_mismatch == "raise":
            raise error(check.message)
        if self.on_mismatch == "warn":
            warnings.warn(check.message, stacklevel=3)
        else:
            logger.warning(check.message)

    def summary(self) -> str:
        h = self.history
        bad = sum(1 for c in h if c.mismatches)
        empty = sum(1 for c in h if c.total == 0)
        return (f"bitmatch: {len(h)} generation steps checked, {sum(c.total for c in h)} tokens in "
                f"{sum(c.seqs for c in h)} sequences, {bad} step(s) with mismatches"
                + (f", {empty} step(s) with nothing compared" if empty else ""))

    def _save_bundle(self, check, res, d: Divergence):
        if self._bundles >= self.max_bundles:
            return None
        self._bundles += 1
        path = os.path.join(self.repro_dir, f"step{check.step}_{check.mode}_{d.tag}")
        cfg = {"step": check.step, "mode": check.mode}
        cfg.update(d.config)
        cfg.update({
            "first_divergence": {"sequence": res.first_divergence[0], "token": res.first_divergence[1],
                                 "token_id": d.token_id,
                                 "rollout": res.first_rollout_value, "rollout_hex": res.first_rollout_hex,
                                 "trainer": res.first_trainer_value, "trainer_hex": res.first_trainer_hex},
            "mismatches": check.mismatches, "total": check.total, "diff_max": check.diff_max,
            "kl_k3": check.kl_k3, "located": d.where + d.weights, "versions": versions(),
            "bitmatch": bitmatch.__version__,
        })
        return write_bundle(path, cfg, d.tensors)


def write_bundle(path: str, config: dict, tensors: dict) -> str:
    """Write a repro bundle (``config.json`` and ``tokens.pt``) into the folder ``path`` and return
    it: the format ``bitmatch replay`` (``bitmatch.diagnostics.replay.read_bundle``) reads."""
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=1, default=str)
    torch.save({k: (v.detach().cpu() if isinstance(v, torch.Tensor) else v) for k, v in tensors.items()},
               os.path.join(path, "tokens.pt"))
    return path


def _compared_seqs(rollout, mask) -> int:
    """Sequences with at least one compared token (rows of a [B, T] tensor; one for a [T] one)."""
    rows = rollout.reshape(-1, rollout.shape[-1]) if rollout.dim() else rollout.reshape(1, 1)
    if mask is None:
        return int(rows.shape[0]) if rows.shape[-1] else 0
    return int((mask.reshape(rows.shape) != 0).any(dim=-1).sum())


# ----------------------------------------------------------------------------- diagnosis helpers

def locate_sentence(trainer_model, rollout_model, ids, mask, *, compute_dtype, block_size=None,
                    written_since_sampling=None) -> str:
    """Run the same tokens through the trainer's and the rollout's model (the rollout's attention
    through a paged cache of ``block_size`` when given, as the engine ran it) and name the first op
    whose bits differ, as one sentence of the mismatch message. ``written_since_sampling``: the
    rollout weights written since the engine sampled (``Engine.weights_written_since_sampling``);
    when any were, the sentence names them as the cause (a locate on the weights as they are now
    cannot see it, and with shared weights it compares a model with itself)."""
    r = locate(trainer_model, rollout_model, ids, mask, compute_dtype_a=compute_dtype,
               compute_dtype_b=compute_dtype, paged_b_block_size=block_size)
    written = list(written_since_sampling or [])
    changed = ""
    if written:
        more = f" and {len(written) - 1} more" if len(written) > 1 else ""
        changed = (f"the weights changed after the rollout sampled: {written[0]!r}{more} were written since "
                   "(their version counters moved), so the rollout's logprobs came from other weights than the "
                   "trainer scored with. With weights shared between rollout and trainer (rollout_weights="
                   "'shared'), score before anything updates them (an optimizer step, a weight load or sync "
                   "between generation and the loss), or give the rollout its own copy (rollout_weights='copy')")
    if r.first_divergent is None:
        if changed:
            return (f"First divergent layer: none on the current weights (all {r.ops_compared} op outputs "
                    f"bit-identical), but {changed}.")
        if _unwrap(trainer_model) is _unwrap(rollout_model):
            return (f"First divergent layer: none, all {r.ops_compared} op outputs (embed_tokens .. lm_head) are "
                    "bit-identical, but trainer and rollout share one model, so this compares the weights as "
                    "they are now: the difference comes from weights written after sampling (a write the "
                    "version counters do not see, e.g. through .data), after the logits (sampler / logprob) or "
                    "from the engine's schedule.")
        return (f"First divergent layer: none, all {r.ops_compared} op outputs (embed_tokens .. lm_head) are "
                "bit-identical between trainer and rollout model: the difference comes after the logits "
                "(sampler / logprob) or from the engine's schedule.")
    lyr = f"layer {r.layer}, op {r.op}" if r.layer is not None else f"op {r.op}"
    return f"First divergent layer: {r.first_divergent} ({lyr})." + (f" Also, {changed}." if changed else "")


def _unwrap(model):
    """The causal LM of a model, a wrapper or a ``bitmatch.Engine`` (its ``.model``)."""
    if not isinstance(model, torch.nn.Module) and isinstance(getattr(model, "model", None), torch.nn.Module):
        model = model.model
    return unwrap_causal_lm(model)


def weights_sentence(bad: list[str]) -> str:
    if not bad:
        return ""
    return f" Rollout weights differ from the trainer's at {len(bad)} tensor(s), first {bad[0]!r}."


def weights_fingerprint(source, compute_dtype) -> str:
    """One hash of every tensor's compute-dtype fingerprint (which weights the step ran with)."""
    import xxhash
    fp = fingerprints(source, dtype=compute_dtype or torch.float32)
    h = xxhash.xxh64()
    for k in sorted(fp):
        h.update(f"{k}={fp[k]};".encode())
    return h.hexdigest()


def versions() -> dict[str, str]:
    out = {}
    for mod in ("torch", "transformers", "trl", "peft", "vllm", "verl"):
        try:
            out[mod] = __import__(mod).__version__
        except Exception:  # not installed, or fails to import: the bundle just omits it
            pass
    return out
