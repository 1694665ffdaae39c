"""TRL adapter: one line makes a stock ``GRPOTrainer`` bitmatched, and proves it on every step.

    from trl import GRPOTrainer
    import bitmatch.adapters.trl

    trainer = bitmatch.adapters.trl.attach(GRPOTrainer(model=..., args=..., reward_funcs=..., ...))
    trainer.train()       # raises BitmatchMismatchError on the first rollout/trainer logprob difference

Why a function that takes the built trainer (and not only ``callbacks=[...]``): a TRL callback never
receives the trainer, and ``on_init_end`` fires before the fused LM head, ``_metrics`` and vLLM
exist; the logprob substitution must happen on the trainer instance. ``attach`` rebinds four
methods on the instance (nothing on the class, so other trainers in the process are untouched)
and adds a ``BitmatchCallback`` that holds the adapter (the transformers ``set_trainer`` pattern):
it re-checks the wiring at ``on_train_begin`` and keeps the per-step history.

What ``attach`` does (trl 1.16.x; the private methods it rebinds are checked at attach time):
- patches the policy (and ``ref_model`` if any) onto ``bitmatch.kernels`` (``bitmatch.patch``);
  PEFT LoRA layers run on the merged weight the rollout receives (``bitmatch.models.lora``);
- ``_get_per_token_logps_and_entropies`` (old, ref and current logprobs) calls
  ``bitmatch.token_logprobs``: fp32 ``log_softmax(logits.float() / T)``, T divided like vLLM (TRL's
  fused head multiplies by 1/T: other bits), autocast off, weights cast by ``compute_cast``;
- without vLLM, ``_generate_single_turn`` samples with ``bitmatch.Engine`` (in-process, paged KV
  cache) and returns its per-token logprobs, which TRL stores as ``sampling_per_token_logps``.
  The engine runs on the policy's own tensors (LoRA layers on their merged weight, kept between
  steps and refreshed in place when A or B change), or (``rollout_weights="copy"``) on a rollout
  copy filled through ``bitmatch.sync.publish`` (fingerprint-verified) whenever the step changed:
  LoRA layers merged with PEFT's own merge arithmetic, as TRL pushes them to vLLM;
- with ``use_vllm=True`` the rollout is vLLM's, made bitmatched by the bitmatch vLLM plugin
  (``bitmatch.adapters.vllm``, enabled with ``BITMATCH=1``); attach refuses to run without it;
- it compares the rollout's logprobs with the trainer's logprobs of the same tokens (bit patterns,
  ``bitmatch.diagnostics.verify.compare``), once per generation step. Where TRL keeps old logprobs
  (``num_iterations > 1``, misaligned accumulation, vLLM importance sampling) those, at generation
  time; otherwise (TRL's default) the logprobs the loss itself computes (``_compute_loss``; TRL's
  old logprobs are then their detached copy), collected over the generation's micro-batches and
  compared when the last one has been through the loss: no extra forward, and what is proven equal
  is what the gradient used. It
  logs ``bitmatch/diff_max``, ``bitmatch/mismatch_tokens``, ``bitmatch/kl_k3`` and what they are
  over, ``bitmatch/compared_tokens``, ``bitmatch/compared_seqs``, into ``trainer._metrics[mode]``
  (they reach wandb / tensorboard with TRL's own), and on any difference applies ``on_mismatch``:
  ``"raise"`` (default), ``"warn"`` or ``"log"``. The message names the step, the first divergent
  sequence and token, both values as hex bits, the first divergent layer
  (``bitmatch.diagnostics.verify.locate``) and the path of a small repro bundle.

``watch(trainer)`` installs only the comparison (no patching), to measure a stock run's gap.
Supported: trl >= 1.16, < 1.17 (``pip install bitmatch[trl]``).
"""
from __future__ import annotations

import logging
import os
import types
import warnings

import torch

import bitmatch
import bitmatch.adapters.vllm as plugin
import bitmatch.sync as bsync
from bitmatch import is_patched
from bitmatch.diagnostics.stepcheck import (
    BitmatchMismatchError,
    Divergence,
    StepCheck,
    StepChecker,
    locate_sentence,
    weights_fingerprint,
    weights_sentence,
)
from bitmatch.logprobs import check_temperature
from bitmatch.models import lora, unwrap_causal_lm
from bitmatch.models.fp8_mode import check_quantization
from bitmatch.models.lora import plain_name
from bitmatch.precision import SUPPORTED_COMPUTE_DTYPES, unsupported_dtype_message

logger = logging.getLogger("bitmatch.trl")

SUPPORTED_TRL = (">=1.16", "<1.17")
_REBOUND = ("_get_per_token_logps_and_entropies", "_generate_single_turn", "_generate_and_score_completions",
            "_compute_loss")
# what a deferred check keeps of each micro-batch the loss sees (TRL splits the generation's tensors)
_CHECKED = ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "tool_mask", "sampling_per_token_logps")
_MULTIMODAL = ("pixel_values", "image_grid_thw", "pixel_attention_mask", "spatial_shapes", "image_sizes",
               "token_type_ids", "mm_token_type_ids", "image_position_ids")

__all__ = ["attach", "watch", "BitmatchCallback", "BitmatchMismatchError", "TrlAdapter", "StepCheck"]


def _require_trl():
    try:
        import trl
        from packaging.version import Version
    except ImportError as e:  # optional dependency
        raise ImportError("bitmatch.adapters.trl needs TRL: pip install bitmatch[trl]") from e
    v = Version(trl.__version__)
    if not (Version("1.16") <= v < Version("1.17")):
        warnings.warn(f"bitmatch.adapters.trl is tested with trl {','.join(SUPPORTED_TRL)}; found {trl.__version__}",
                      stacklevel=3)
    return trl


def _callback_base():
    from transformers import TrainerCallback
    return TrainerCallback


class BitmatchCallback(_callback_base()):
    """Holds the adapter (a TRL callback cannot reach the trainer otherwise); checks the wiring
    when training starts and keeps the per-step comparisons in ``history``."""

    def __init__(self, adapter: "TrlAdapter"):
        self.adapter = adapter

    @property
    def history(self) -> list[StepCheck]:
        return self.adapter.history

    def on_train_begin(self, args, state, control, **kwargs):
        self.adapter.check_wiring()

    def on_train_end(self, args, state, control, **kwargs):
        self.adapter.flush()
        if self.adapter.history:
            logger.info(self.adapter.checker.summary())


# ----------------------------------------------------------------------------- the adapter

class TrlAdapter:
    """State behind ``attach`` / ``watch``: the trainer, the engine, the rollout weights, history."""

    def __init__(self, trainer, *, on_mismatch: str, check_only: bool, compute_dtype, rollout_weights: str,
                 repro_dir, engine_kwargs, max_bundles: int, quantization: str | None = None):
        self.checker = StepChecker(on_mismatch, repro_dir or os.path.join(trainer.args.output_dir, "bitmatch_repro"),
                                   max_bundles)
        if rollout_weights not in ("auto", "shared", "copy"):
            raise ValueError(f"attach: rollout_weights must be 'auto', 'shared' or 'copy', got {rollout_weights!r}")
        self.trainer = trainer
        self.check_only = check_only
        self.engine = None
        self.rollout_copy = None   # bitmatch.sync.RolloutCopy when rollout_weights == "copy"
        self._synced_step = None
        self.weight_version = None
        self._orig = {n: getattr(trainer, n) for n in _REBOUND}
        self.is_peft = any(lora.is_lora_layer(m) for m in trainer.model.modules())
        self.compute_dtype = None if check_only else self._pick_dtype(compute_dtype)
        if rollout_weights == "auto":
            # PEFT too: the engine's LoRA layers read kept merged weights (bitmatch.models.lora), the
            # bits a copy would hold, refreshed in place when A / B change: no per-step publish
            rollout_weights = "shared"
        self.rollout_weights = rollout_weights
        self.engine_kwargs = dict(engine_kwargs or {})
        self.quantization = check_quantization(quantization, "attach")
        # "loss": without TRL's old logprobs, compare against the loss's own (no extra forward);
        # "generation": a separate no-grad trainer forward right after the rollout (watch() mode,
        # and what a benchmark sets to time the difference)
        self.check_at = "generation" if check_only else "loss"
        self._deferred = {}     # mode -> _Deferred: a generation whose check waits for the loss
        self._capture = None    # a list while _compute_loss runs with a deferred check

    # -- setup ------------------------------------------------------------------------------
    def _pick_dtype(self, compute_dtype):
        p = unwrap_causal_lm(self.trainer.model).get_input_embeddings().weight.dtype
        if compute_dtype is None:
            args = self.trainer.args
            if p == torch.float32 and getattr(args, "bf16", False):
                return torch.bfloat16   # what bf16 mixed precision computes, and what a bf16 rollout holds
            if p not in SUPPORTED_COMPUTE_DTYPES:  # patch would refuse it with its own option's name
                raise ValueError(unsupported_dtype_message(
                    "attach", p, "pass attach(trainer, compute_dtype=torch.bfloat16) (fp32 master weights with "
                    "GRPOConfig(bf16=True) compute in bf16)"))
            return p
        if compute_dtype not in SUPPORTED_COMPUTE_DTYPES:
            raise ValueError(f"attach: compute_dtype must be torch.bfloat16 or torch.float32 (bitmatch computes in "
                             f"bf16 or fp32), got {compute_dtype}: pass attach(trainer, compute_dtype=torch.bfloat16)")
        return compute_dtype

    def install(self):
        t = self.trainer
        missing = [n for n in _REBOUND if not callable(getattr(t, n, None))]
        if missing:
            raise RuntimeError(f"attach: this GRPOTrainer has no {missing}; bitmatch.adapters.trl supports trl "
                               f"{','.join(SUPPORTED_TRL)} (pip install bitmatch[trl])")
        if not self.check_only:
            self._check_config()
            for m in self._trained_models():
                bitmatch.patch(m, compute_dtype=self.compute_dtype, quantization=self.quantization)
            if t.use_vllm:
                if self.quantization is not None:
                    raise ValueError(f"attach: quantization={self.quantization!r} runs on bitmatch.Engine; the vLLM "
                                     "plugin refuses quantization (docs/fp8.md): set GRPOConfig(use_vllm=False) or "
                                     "leave quantization None")
                self._check_vllm_plugin()
            elif t.rollout_func is None:
                t._generate_single_turn = types.MethodType(_generate_single_turn, t)
            t._get_per_token_logps_and_entropies = types.MethodType(_per_token_logps_and_entropies, t)
            t._compute_loss = types.MethodType(_compute_loss, t)
        t._generate_and_score_completions = types.MethodType(_generate_and_score_completions, t)
        t._bitmatch = self
        self.callback = BitmatchCallback(self)
        t.add_callback(self.callback)
        return t

    def _trained_models(self):
        t = self.trainer
        out = [t.model]
        if getattr(t, "ref_model", None) is not None:
            out.append(t.ref_model)
        return out

    def _check_config(self):
        t, a = self.trainer, self.trainer.args
        # the sampling options are checked here, by their GRPOConfig names, not inside the first step
        check_temperature("attach", t.temperature, name="GRPOConfig.temperature")
        top_p = t.top_p if t.top_p is not None else 1.0
        if isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not 0.0 < top_p <= 1.0:
            raise ValueError(f"attach: GRPOConfig.top_p must be a float in (0, 1] (1.0: no top-p), got {t.top_p!r}")
        top_k = t.top_k if t.top_k is not None else 0
        if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < -1:
            raise ValueError(f"attach: GRPOConfig.top_k must be an int >= 1, or 0 / -1 / None for no top-k, got "
                             f"{t.top_k!r}")
        if getattr(t, "_is_vlm", False):
            raise ValueError("attach: vision-language models are not supported by bitmatch yet (text-only causal "
                             "LMs; bitmatch.models.check_supported(model) says which)")
        if getattr(t, "aux_loss_enabled", False):
            raise ValueError("attach: the MoE router auxiliary (load-balancing) loss is not computed on bitmatch "
                             "kernels; set GRPOConfig(router_aux_loss_coef=0.0)")
        if getattr(a, "use_transformers_paged", False) or getattr(t, "use_transformers_continuous_batching", False):
            raise ValueError("attach: GRPOConfig(use_transformers_paged=True) is not supported; leave it False "
                             "(bitmatch.Engine generates instead)")
        if getattr(a, "cast_lm_head_to_fp32", False):
            raise ValueError("attach: GRPOConfig(cast_lm_head_to_fp32=True) replaces lm_head.forward; set it False "
                             "(bitmatch computes the logprob in fp32 from the compute-dtype logits, as vLLM)")
        if not t.use_vllm and t.rollout_func is None:
            bad = {"repetition_penalty": (a.repetition_penalty, 1.0), "min_p": (a.min_p, None)}
            for k, (v, ok) in bad.items():
                if v != ok and not (k == "min_p" and v == 0.0):
                    raise ValueError(f"attach: GRPOConfig({k}={v}) is not supported by bitmatch.Engine; set "
                                     f"{k}={ok!r}")
            if a.generation_kwargs:
                raise ValueError(f"attach: GRPOConfig(generation_kwargs={a.generation_kwargs}) is not supported by "
                                 "bitmatch.Engine; use temperature / top_p / top_k / max_completion_length")
        for m in self._trained_models():
            for n, mod in m.named_modules():
                if lora.is_lora_layer(mod):
                    base = mod.get_base_layer() if hasattr(mod, "get_base_layer") else None
                    if not isinstance(base, torch.nn.Linear):
                        raise ValueError(
                            f"attach: the LoRA adapter on {plain_name(n)} ({type(mod).__name__}) wraps a "
                            f"{type(base).__name__}, not an nn.Linear: bitmatch runs LoRA on Linear layers only. "
                            "Leave it out of LoraConfig(target_modules=...) (on MoE models the experts' stacked "
                            "weights match 'gate_proj' / 'up_proj' / 'down_proj': target the attention projections, "
                            "e.g. ['q_proj', 'k_proj', 'v_proj', 'o_proj'])")
                    lora.check_lora_layer(mod, n)

    def _check_vllm_plugin(self):
        # the plugin module itself is always importable (it imports no vLLM until enabled)
        if getattr(self.trainer, "vllm_mode", "colocate") == "server":
            # the server is another process: its plugin cannot be checked from here; the per-step
            # comparison proves it (a stock server fails the first step)
            logger.info("bitmatch: vLLM server mode: start the server with BITMATCH=1 trl vllm-serve ...")
        elif not plugin.is_enabled():
            raise RuntimeError("attach: GRPOConfig(use_vllm=True, vllm_mode='colocate') needs the bitmatch vLLM "
                               "plugin enabled before the trainer builds vLLM: set BITMATCH=1 in the environment "
                               "(or call bitmatch.adapters.vllm.enable()) before GRPOTrainer(...)")

    def check_wiring(self):
        """Raise if something undid attach (a re-wrapped model, a replaced method)."""
        t = self.trainer
        if not self.check_only:
            for m in self._trained_models():
                if not is_patched(m):
                    raise RuntimeError("bitmatch: the policy is no longer patched at train start; call attach() on "
                                       "the trainer after any code that rebuilds trainer.model")
        for n in _REBOUND:
            f = getattr(t, n)
            if n in ("_get_per_token_logps_and_entropies", "_compute_loss") and self.check_only:
                continue
            if n == "_generate_single_turn" and (self.check_only or t.use_vllm or t.rollout_func is not None):
                continue
            if getattr(f, "__func__", None) not in (_per_token_logps_and_entropies, _generate_single_turn,
                                                   _generate_and_score_completions, _compute_loss):
                raise RuntimeError(f"bitmatch: trainer.{n} was replaced after attach(); attach last")

    # -- rollout --------------------------------------------------------------------------
    @property
    def rollout_model(self):
        """The model the engine samples from when it is a copy (None while shared or not built)."""
        return None if self.rollout_copy is None else self.rollout_copy.model

    @property
    def receiver(self):
        return None if self.rollout_copy is None else self.rollout_copy.receiver

    @rollout_model.setter
    def rollout_model(self, value):
        self._drop_copy(value)

    @receiver.setter
    def receiver(self, value):
        self._drop_copy(value)

    def _drop_copy(self, value):
        # setting either to None releases the copy (what a benchmark does between runs)
        if value is not None:
            raise AttributeError("bitmatch: the rollout copy is built by sync_rollout(); set it to None to release it")
        self.rollout_copy = None

    def rollout_weights_source(self):
        """(HF name, tensor) pairs the rollout must hold: merged LoRA weights, the rest as they are."""
        return lora.merged_state_dict(self.trainer.accelerator.unwrap_model(self.trainer.model))

    def engine_budget(self) -> dict:
        """The engine's KV budget as TRL's colocated vLLM gets it: ``vllm_gpu_memory_utilization``
        of the GPU for the engine itself, beside the trainer (unless ``engine_kwargs`` sets one).
        vLLM's server default (0.9 of the device) would take the memory the training step needs."""
        if any(k in self.engine_kwargs for k in ("kv_cache_bytes", "num_gpu_blocks", "gpu_memory_utilization",
                                                 "memory_share")):
            return {}
        return dict(gpu_memory_utilization=float(getattr(self.trainer.args, "vllm_gpu_memory_utilization", 0.3)),
                    memory_share="engine")

    def engine_batch(self) -> dict:
        """The engine's ``max_num_seqs`` as TRL sizes its colocated vLLM: the whole generation
        batch of this rank (``per_device_train_batch_size * steps_per_generation``) runs at once,
        so a step of 32 prompts x 8 generations is 48 decode steps of 256 rows, not four rounds of
        64 (unless ``engine_kwargs`` sets it). Bits do not depend on it: every kernel is
        batch-invariant."""
        if "max_num_seqs" in self.engine_kwargs:
            return {}
        args = self.trainer.args
        steps = getattr(args, "steps_per_generation", None) or getattr(args, "gradient_accumulation_steps", 1) or 1
        return dict(max_num_seqs=max(1, int(args.per_device_train_batch_size) * int(steps)))

    def sync_rollout(self):
        """Make the rollout hold the current weights (once per optimizer step, as TRL's vLLM sync)."""
        step = self.trainer.state.global_step
        if self.engine is None:
            if self.rollout_weights == "copy":
                self.rollout_copy = bsync.RolloutCopy(self.trainer.accelerator.unwrap_model(self.trainer.model),
                                                      self.compute_dtype, quantization=self.quantization)
                model = self.rollout_copy.model
            else:
                model = self.trainer.accelerator.unwrap_model(self.trainer.model)
            kw = dict(seed=int(self.trainer.args.seed) + self.trainer.accelerator.process_index)
            kw.update(self.engine_budget())
            kw.update(self.engine_batch())
            kw.update(self.engine_kwargs)
            self.engine = bitmatch.Engine(model, **kw)
        if self.rollout_weights == "copy" and self._synced_step != step:
            self.rollout_copy.publish(step)
        self._synced_step = step
        self.weight_version = step
        if self.rollout_copy is not None:
            self.rollout_copy.require_ready(step)

    # -- comparison -----------------------------------------------------------------------
    @property
    def history(self) -> list[StepCheck]:
        return self.checker.history

    def compare_step(self, output: dict, mode: str) -> StepCheck | None:
        """Check a generation step's output now (against TRL's old logprobs, or a trainer forward),
        or, with ``check_at == "loss"`` and no old logprobs, register it for the loss's logprobs
        (``collect``) and return None."""
        t = self.trainer
        if output.get("sampling_per_token_logps") is None:
            raise RuntimeError("bitmatch: this generation step returned no rollout logprobs, so nothing proves the "
                               "rollout matches the trainer (stock TRL without vLLM keeps none): use attach(), "
                               "use_vllm=True, or a rollout_func that returns 'logprobs'")
        self.flush(mode)  # a previous generation the loss never fully consumed (training stopped early)
        if output.get("old_per_token_logps") is None and self.check_at == "loss":
            self._deferred[mode] = _Deferred(step=t.state.global_step, rows=output["prompt_ids"].size(0))
            return None
        return self._compare(output, output.get("old_per_token_logps"), mode, t.state.global_step)

    def collect(self, mode: str, inputs: dict, trainer_lp: torch.Tensor):
        """One micro-batch through the loss: keep its rollout and loss logprobs; compare the
        generation once all its rows have been seen."""
        d = self._deferred[mode]
        d.pieces.append({k: inputs[k] for k in _CHECKED if inputs.get(k) is not None})
        d.logprobs.append(trainer_lp.detach())
        d.seen += trainer_lp.size(0)
        if d.seen >= d.rows:
            self.flush(mode)

    def flush(self, mode: str | None = None):
        """Compare what a deferred check has collected (all modes when ``mode`` is None)."""
        for m in ([mode] if mode is not None else list(self._deferred)):
            d = self._deferred.pop(m, None)
            if d is None:
                continue
            if not d.pieces:   # rolled out, never trained on: nothing of it reached a gradient
                logger.info("bitmatch: the %s generation of step %d never reached the loss; not compared", m, d.step)
                continue
            keys = d.pieces[0].keys()
            output = {k: torch.cat([p[k] for p in d.pieces]) for k in keys}
            self._compare(output, torch.cat(d.logprobs), m, d.step)

    def _compare(self, output: dict, trainer_lp, mode: str, step: int) -> StepCheck:
        t = self.trainer
        sampling = output["sampling_per_token_logps"]
        ids = torch.cat([output["prompt_ids"], output["completion_ids"]], dim=1)
        mask = torch.cat([output["prompt_mask"], output["completion_mask"]], dim=1)
        keep = output["completion_ids"].size(1)
        cmask = output["completion_mask"]
        if "tool_mask" in output:
            cmask = cmask * output["tool_mask"]
        if trainer_lp is None:
            with torch.no_grad():
                trainer_lp, _, _ = t._get_per_token_logps_and_entropies(t.model, ids, mask, keep)
        m = t._metrics[mode]

        def log_metrics(d):
            for k, v in d.items():
                m[k].append(v)

        def diagnose(res):
            s, j = res.first_divergence
            plen = output["prompt_ids"].size(1)
            where, weights = self._locate(ids[s:s + 1, :plen + j + 1], mask[s:s + 1, :plen + j + 1])
            tensors = {"prompt_ids": output["prompt_ids"], "prompt_mask": output["prompt_mask"],
                       "completion_ids": output["completion_ids"], "completion_mask": cmask,
                       "rollout_logprobs": sampling.float(), "trainer_logprobs": trainer_lp.float()}
            return Divergence(int(output["completion_ids"][s, j]), where, weights, self._bundle_config(mode),
                              tensors, f"rank{t.accelerator.process_index}")

        def reduce(stats):
            return t.accelerator.gather(stats.to(t.accelerator.device))

        return self.checker.check(step=step, mode=mode, rollout=sampling, trainer=trainer_lp,
                                  mask=cmask, reduce=reduce, diagnose=diagnose, log_metrics=log_metrics)

    def _locate(self, ids, mask):
        """(first divergent layer sentence, differing rollout weights sentence)."""
        if self.check_only:
            return ("First divergent layer: not located (watch() mode: the trainer is not on bitmatch kernels; "
                    "use attach()).", "")
        weights = ""
        if self.rollout_model is None:
            rollout = self.engine.model if self.engine is not None else None
        else:
            rollout = self.rollout_model
            weights = weights_sentence(self.rollout_copy.differing())
        if rollout is None:  # vLLM: its weights live in another engine
            return ("First divergent layer: not located (the rollout ran in vLLM; run the same tokens through "
                    "bitmatch.diagnostics.verify.locate against the plugin's model).", weights)
        block = self.engine.block_size if self.engine is not None else None
        # shared weights written between sampling and scoring: a forward on the weights as they are
        # now cannot show it; the engine's version-counter snapshot of its sampling step can
        written = self.engine.weights_written_since_sampling() if self.engine is not None else None
        return locate_sentence(self.trainer.model, rollout, ids, mask, compute_dtype=self.compute_dtype,
                               block_size=block, written_since_sampling=written), weights

    def _bundle_config(self, mode):
        t = self.trainer
        return {"temperature": t.temperature, "top_p": t.top_p, "top_k": t.top_k,
                "compute_dtype": str(self.compute_dtype), "rollout_weights": self.rollout_weights,
                "check_only": self.check_only, "use_vllm": bool(t.use_vllm), "weight_version": self.weight_version,
                "weights_written_since_sampling": (self.engine.weights_written_since_sampling()[:16]
                                                   if self.engine is not None else None),
                "weights_fingerprint": weights_fingerprint(self.rollout_weights_source(), self.compute_dtype),
                "model_config": t.model.config.to_dict() if hasattr(t.model.config, "to_dict") else None}


class _Deferred:
    """A generation step whose check waits for the loss: its rows, and the micro-batches seen."""

    def __init__(self, step: int, rows: int):
        self.step, self.rows, self.seen = step, rows, 0
        self.pieces, self.logprobs = [], []   # per micro-batch: its checked inputs, the loss logprobs


# ----------------------------------------------------------------------------- rebound methods
# Bound to the trainer instance (self is the GRPOTrainer); state lives in self._bitmatch.

def _per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, batch_size=None,
                                   compute_entropy=False, compute_aux_loss=False, **mm):
    """bitmatch's ``_get_per_token_logps_and_entropies``: ``bitmatch.token_logprobs`` at the rollout's
    temperature, top-k / top-p mask (the distribution the rollout sampled from; the ref model's stay
    full-vocabulary, so a token outside its own mask cannot make the KL infinite) and compute dtype,
    autocast off. The bits do not depend on ``batch_size``."""
    bm = self._bitmatch
    used = [k for k, v in mm.items() if v is not None and k in _MULTIMODAL or (k == "num_images" and v)]
    if used:
        raise ValueError(f"bitmatch: multimodal inputs {used} are not supported (text-only dense models)")
    if compute_aux_loss:
        raise ValueError("bitmatch: compute_aux_loss (the MoE router load-balancing loss) is not computed on "
                         "bitmatch kernels; set GRPOConfig(router_aux_loss_coef=0.0)")
    batch_size = batch_size or input_ids.size(0)
    masked = model is not getattr(self, "ref_model", None)
    top_k, top_p = (self.top_k or None, self.top_p) if masked else (None, None)
    lps, ents = [], []
    dev_type = input_ids.device.type
    for a in range(0, input_ids.size(0), batch_size):
        ids, msk = input_ids[a:a + batch_size], attention_mask[a:a + batch_size]
        with torch.autocast(device_type=dev_type, enabled=False):
            out = bitmatch.token_logprobs(model, ids, msk, temperature=self.temperature, top_k=top_k, top_p=top_p,
                                          compute_dtype=bm.compute_dtype, return_entropy=compute_entropy)
        lp, ent = out if compute_entropy else (out, None)
        lps.append(lp[:, -logits_to_keep:])
        if compute_entropy:
            ents.append(ent[:, -logits_to_keep:])
    lp = torch.cat(lps)
    if bm._capture is not None and not bm._capture:   # the loss's own logprobs (its first call)
        bm._capture.append(lp.detach())
    return lp, (torch.cat(ents) if compute_entropy else None), None


def _compute_loss(self, model, inputs):
    """TRL's ``_compute_loss``; while a generation's check is deferred, the logprobs it computes
    are kept for that check (``TrlAdapter.collect``)."""
    bm = self._bitmatch
    mode = "train" if self.model.training else "eval"
    if mode not in bm._deferred:
        return bm._orig["_compute_loss"](model, inputs)
    bm._capture = []
    try:
        loss = bm._orig["_compute_loss"](model, inputs)
        got = bm._capture
    finally:
        bm._capture = None
    if not got:
        raise RuntimeError("bitmatch: TRL's _compute_loss computed no per-token logprobs through "
                           "_get_per_token_logps_and_entropies, so the rollout cannot be checked against them; "
                           "this TRL version is not supported (pip install bitmatch[trl])")
    bm.collect(mode, inputs, got[0])
    return loss


def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
    """Rollouts through ``bitmatch.Engine``: (completion_ids, per-token logprobs)."""
    if images is not None or multimodal_fields:
        raise ValueError("bitmatch: multimodal prompts are not supported (text-only dense models)")
    bm = self._bitmatch
    bm.sync_rollout()
    top_k = self.top_k if self.top_k and self.top_k > 0 else -1
    sp = bitmatch.SamplingParams(temperature=float(self.temperature), top_p=float(self.top_p or 1.0), top_k=top_k,
                                 max_tokens=int(self.max_completion_length),
                                 stop_token_ids=[int(e) for e in self.eos_token_ids], ignore_eos=True)
    prompts = [list(map(int, p)) for p in prompt_ids]
    outs = bm.engine.generate(prompts, sp, use_tqdm=False)
    completion_ids = [list(o.outputs[0].token_ids) for o in outs]
    logprobs = [list(o.outputs[0].sampled_logprobs) for o in outs]  # under top_k / top_p: the masked distribution
    return completion_ids, logprobs


def _generate_and_score_completions(self, inputs):
    """TRL's step, then the proof: rollout logprobs vs the trainer's for the same tokens."""
    bm = self._bitmatch
    output = bm._orig["_generate_and_score_completions"](inputs)
    mode = "train" if self.model.training else "eval"
    bm.compare_step(output, mode)
    return output


# ----------------------------------------------------------------------------- public API

def attach(trainer, *, on_mismatch: str = "raise", compute_dtype: torch.dtype | None = None,
           rollout_weights: str = "auto", repro_dir: str | None = None, engine_kwargs: dict | None = None,
           max_bundles: int = 3, quantization: str | None = None):
    """Make ``trainer`` (a built ``trl.GRPOTrainer``) bitmatched; returns the same trainer.

    on_mismatch: "raise" (default: ``BitmatchMismatchError`` at the first differing token), "warn"
    or "log" (metrics and a warning; training goes on). compute_dtype: the dtype weights are cast
    to at use on both sides (default: bf16 under ``GRPOConfig(bf16=True)`` with fp32 weights, else
    the weights' dtype). rollout_weights (without vLLM): "shared" (the engine reads the policy's
    own tensors; PEFT LoRA layers on kept merged weights), "copy" (a rollout copy synced through
    ``bitmatch.sync`` every step), "auto" (= "shared"). repro_dir: where repro bundles go (default
    ``<output_dir>/bitmatch_repro``).
    engine_kwargs: passed to ``bitmatch.Engine`` (block_size, kv_cache_bytes, max_num_seqs, ...).
    Without a KV budget there, the engine takes ``GRPOConfig.vllm_gpu_memory_utilization`` of the
    GPU for itself, as TRL's colocated vLLM does (``Engine(memory_share="engine")``), and without
    ``max_num_seqs`` there it runs the rank's whole generation batch at once (TRL's rule for it).
    quantization: None, or "fp8": trainer and rollout both run the projections W8A8 on block-FP8
    weights quantized from the master weights (docs/fp8.md; not with use_vllm or LoRA).

    Invariance: after attach, every logprob the rollout reports equals the trainer's logprob of
    the same token bit for bit, and each generation step checks it.
    """
    _require_trl()
    if getattr(trainer, "_bitmatch", None) is not None:
        raise RuntimeError("attach: this trainer is already attached (call attach once per trainer)")
    if not hasattr(trainer, "_generate_and_score_completions"):
        raise TypeError(f"attach: expected a trl.GRPOTrainer, got {type(trainer).__name__}")
    return TrlAdapter(trainer, on_mismatch=on_mismatch, check_only=False, compute_dtype=compute_dtype,
                      rollout_weights=rollout_weights, repro_dir=repro_dir, engine_kwargs=engine_kwargs,
                      max_bundles=max_bundles, quantization=quantization).install()


def watch(trainer, *, on_mismatch: str = "log", repro_dir: str | None = None, max_bundles: int = 1):
    """Only compare (no patching, no engine): log the stock gap between the rollout's logprobs
    (vLLM's, or a ``rollout_func``'s) and the trainer's, as ``bitmatch/*`` metrics."""
    _require_trl()
    if getattr(trainer, "_bitmatch", None) is not None:
        raise RuntimeError("watch: this trainer is already attached")
    return TrlAdapter(trainer, on_mismatch=on_mismatch, check_only=True, compute_dtype=None,
                      rollout_weights="shared", repro_dir=repro_dir, engine_kwargs=None,
                      max_bundles=max_bundles).install()
