"""The embedded rollout engine: ``Engine(model).generate(prompts, SamplingParams(...))``.

Shaped like ``vllm.LLM.generate``. The engine shares the HF module's parameter tensors (no
copy): an optimizer step on the module is seen by the next ``generate``. Every logprob it
reports equals, bit for bit, what ``bitmatch.token_logprobs`` computes for the same token in
the trainer, whatever the batch, chunking, block size, preemption or prefix-cache reuse.

Fed by a receiver (``bitmatch.sync.receive(model)``), the engine refuses to step until a verified
weight version is in place, holds the receiver's lock for each step (no switch inside a step),
and stamps every ``RequestOutput`` with the version and fingerprint it was sampled with
(``weights.py``). A request's inputs are checked in ``requests.py``, the KV budget sized by
``model_runner.kv_cache_blocks``.
"""
from __future__ import annotations

import contextlib
import os

import torch
import xxhash

from bitmatch.engine.block_manager import BlockManager
from bitmatch.engine.config import EngineConfig, positive_int
from bitmatch.engine.model_runner import ModelRunner, kv_cache_blocks
from bitmatch.engine.requests import batch_requests, check_sampling_params, token_ids
from bitmatch.engine.sampling import SamplingParams
from bitmatch.engine.scheduler import Scheduler
from bitmatch.engine.sequence import RequestOutput, Sequence
from bitmatch.engine.weights import (
    ManifestDigest,
    engine_opened,
    holding_weights,
    weight_versions as weight_versions,
    written_since,
)
from bitmatch.models import cache_groups, check_supported, load_model, spec_of, unwrap_causal_lm
from bitmatch.models.fp8_mode import check_model
from bitmatch.models.hub import resolve_checkpoint
from bitmatch.models.registry import patch_state, tp_step
from bitmatch.patching import unsupported_param_dtypes
from bitmatch.sync import WeightVersionError, weight_state


def _closed_error(where: str) -> RuntimeError:
    return RuntimeError(f"{where}: this engine was closed (Engine.close() or the end of its with block) and its KV "
                        "cache freed; build a new bitmatch.Engine(model)")


def _check_compute_dtype(lm) -> None:
    """Refuse at construction what the kernels would refuse at the first step (patch's rule): the
    engine computes in the patch's compute_dtype, else in the parameters' dtype."""
    st = patch_state(lm)
    if st is not None and st.compute_dtype is not None:
        return
    bad = unsupported_param_dtypes(lm)
    if bad:
        raise ValueError(f"Engine: the model's parameters are {', '.join(bad)}, but bitmatch computes in bf16 or "
                         "fp32: load it with dtype=torch.bfloat16 (or torch.float32), call model.to(torch.bfloat16), "
                         "or bitmatch.patch(model, compute_dtype=torch.bfloat16) before Engine(model)")


class Engine:
    """Paged-KV, continuously batched rollout engine on bitmatch kernels.

    model: an HF causal LM module (patched or not; used in place) or a checkpoint path
    (loaded with ``bitmatch.models.load_model``). KV budget: ``num_gpu_blocks`` blocks or
    ``kv_cache_bytes`` bytes; by default on CUDA, vLLM's rule: ``gpu_memory_utilization`` of the
    device's memory minus what is in use (weights, other processes) minus the activation peak of a
    profiled step of ``max_num_batched_tokens`` tokens and ``max_num_seqs`` sampled rows
    (``model_runner.profile_kv_budget``); 512 MiB on CPU. ``memory_share="engine"``: the fraction
    is the engine's own beside a trainer in the same process (TRL's colocate rule; what
    ``adapters.trl.attach`` passes): only the engine's activation peak and derived weights count.
    ``enforce_eager``: no CUDA graphs (vLLM's flag); otherwise pure-decode steps on CUDA replay one
    graph per padded batch bucket (``bitmatch.engine.graphs``) for contexts up to
    ``max_seq_len_to_capture``; same bits either way.
    ``seed`` seeds the requests whose SamplingParams have no seed (with the request's index).
    ``enable_prefix_caching`` reuses full KV blocks across requests inside a ``generate`` call
    (the n samples of one prompt share its prefill, in the same step too); the cache is reset at the
    start of every ``generate`` because the weights may have changed.
    ``max_model_len``: the longest prompt + completion (vLLM's; default and upper bound: the model's
    ``max_position_embeddings``).

    vLLM's engine arguments by name: accepted are ``block_size``, ``num_gpu_blocks``,
    ``max_num_seqs``, ``max_num_batched_tokens``, ``max_model_len``, ``enable_chunked_prefill``,
    ``enable_prefix_caching``, ``seed``, ``enforce_eager``, ``gpu_memory_utilization`` and
    ``max_seq_len_to_capture`` (the fields of ``EngineConfig``: ``Engine(model, config=EngineConfig(...))``
    is the same engine; ``engine.config`` holds them), and ``quantization`` (None or "fp8": docs/fp8.md);
    refused with the fix (ValueError) are the names of ``VLLM_REFUSED``
    (``tensor_parallel_size``, ``dtype``, ``kv_cache_dtype``, ``swap_space``,
    ``cpu_offload_gb``, ``num_gpu_blocks_override``, ``trust_remote_code``, ...); any other keyword
    is a TypeError.

    Memory: ``close()`` (or ``with Engine(...) as engine:``) frees the KV cache, the CUDA graphs and
    their pool at once, without the cycle collector; the last engine over a model to close (or to
    be dropped) also drops the copies the engines derived on it (fused projections, kept casts of
    fp32 masters). A closed engine refuses ``generate`` / ``add_request`` / ``step``.
    """

    def __init__(self, model, tokenizer=None, *, config: EngineConfig | None = None, **engine_args):
        self._closed = True   # until built: close() of a half-built engine does nothing
        if config is not None and engine_args:
            raise TypeError(f"Engine: pass config= or keyword arguments, not both (got config and "
                            f"{sorted(engine_args)}); dataclasses.replace(config, ...) changes a field")
        if config is not None and not isinstance(config, EngineConfig):
            raise TypeError(f"Engine: config must be a bitmatch.engine.EngineConfig, got {type(config).__name__}")
        cfg = self.config = config if config is not None else EngineConfig.from_kwargs(**engine_args)
        block_size, max_num_seqs, max_num_batched_tokens = cfg.block_size, cfg.max_num_seqs, cfg.max_num_batched_tokens
        seed, enforce_eager, max_seq_len_to_capture = cfg.seed, cfg.enforce_eager, cfg.max_seq_len_to_capture
        enable_chunked_prefill, enable_prefix_caching = cfg.enable_chunked_prefill, cfg.enable_prefix_caching
        max_model_len = cfg.max_model_len
        if isinstance(model, (str, os.PathLike)):
            path = resolve_checkpoint(model, who="Engine")  # missing folder / bad hub name: fails fast
            model = load_model(path)
            if tokenizer is None:
                try:
                    from transformers import AutoTokenizer
                    tokenizer = AutoTokenizer.from_pretrained(path)
                except Exception:  # a checkpoint without a tokenizer: token-id prompts only
                    tokenizer = None
        if not isinstance(model, torch.nn.Module):
            raise ValueError(f"Engine: model must be an HF causal LM module or a checkpoint path, got {type(model)}")
        check_supported(model)
        lm = unwrap_causal_lm(model)  # config / vocabulary of the causal LM inside any wrapper
        self.block_size, self.max_num_seqs = block_size, max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        _check_compute_dtype(lm)
        self.model, self.tokenizer, self.seed = model, tokenizer, seed
        self.device = next(model.parameters()).device
        self.vocab_size = lm.lm_head.weight.shape[0]
        self.max_model_len = getattr(lm.config, "max_position_embeddings", None)
        self._len_limit = f"the model's max_position_embeddings={self.max_model_len}"
        if max_model_len is not None:
            if self.max_model_len is not None and max_model_len > self.max_model_len:
                raise ValueError(f"Engine: max_model_len={max_model_len} is longer than the model's "
                                 f"max_position_embeddings={self.max_model_len}; pass at most that")
            self.max_model_len = max_model_len
            self._len_limit = f"max_model_len={max_model_len}"
        self._lm = lm
        self._family = spec_of(lm)[0]
        st = patch_state(lm)
        # the trainer's default is the patch's too (token_logprobs): both sides agree unless told otherwise
        self.quantization = cfg.quantization if cfg.quantization is not None else (
            None if st is None else st.quantization)
        check_model(lm, self._family, self.quantization, "Engine")
        self._idle = True  # no request running: the next step rebuilds derived weights (fused copies)
        self._digests = ManifestDigest()  # of the version last stepped with
        groups = cache_groups(model)
        per_seq = [g.name for g in groups if g.kind == "per_seq"]
        if per_seq and enable_prefix_caching:
            raise ValueError(f"Engine: enable_prefix_caching=True is not supported for this model: its cache "
                             f"group(s) {per_seq} hold per-sequence state (a recurrent state), which a reused "
                             "prefix block does not carry; use enable_prefix_caching=False")
        num_gpu_blocks, self.kv_profile = kv_cache_blocks(model, groups, cfg, self.max_model_len, self.quantization)
        self.num_gpu_blocks = positive_int("num_gpu_blocks", num_gpu_blocks)
        self.enable_chunked_prefill = bool(enable_chunked_prefill)
        self.block_manager = BlockManager(self.num_gpu_blocks, self.block_size, bool(enable_prefix_caching),
                                          num_state_slots=self.max_num_seqs)
        self.scheduler = Scheduler(self.block_manager, self.max_num_seqs, self.max_num_batched_tokens,
                                   self.enable_chunked_prefill)
        self.model_runner = ModelRunner(model, self.block_size, self.num_gpu_blocks, self.max_num_seqs,
                                        max_num_seqs=self.max_num_seqs, enforce_eager=bool(enforce_eager),
                                        max_seq_len_to_capture=max_seq_len_to_capture,
                                        quantization=self.quantization)
        eos = getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else \
            getattr(lm.config, "eos_token_id", None)
        self.eos_token_ids = set(eos if isinstance(eos, (list, tuple)) else ([] if eos is None else [eos]))
        self._num_requests = 0
        self._seqs: dict[str, Sequence] = {}
        self.sampled_weights: dict | None = None   # weight_versions(model) when the engine last started work
        # an engine dropped without close() still counts down (its KV cache goes with it)
        self._finalizer = engine_opened(self, lm)
        self._closed = False
        self._finalizer.atexit = False   # at exit the process gives everything back anyway

    # -- lifetime ---------------------------------------------------------------------------
    def close(self) -> None:
        """Free the KV cache, the CUDA graphs and their memory pool now (idempotent). Running
        requests are aborted; the engine refuses further work by name. The last engine over a
        model to close drops the copies derived on the model too. The model itself is the caller's."""
        if self._closed:
            return
        self._closed = True
        self.abort_all()
        self.model_runner.close()
        self._finalizer()

    def __enter__(self) -> "Engine":
        if self._closed:
            raise _closed_error("Engine.__enter__")
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _check_open(self, where: str) -> None:
        if self._closed:
            raise _closed_error(where)

    @contextlib.contextmanager
    def record(self, recorder):
        """Inside the block, hand ``recorder`` every op output of every step (its ``step(view)``
        and ``record(name, value, rows)``: ``bitmatch.engine.recording``). Observation only: each
        step takes the path it takes unrecorded (a pure-decode step still replays a CUDA graph)
        and computes the same bits. Nests; undone on exit, exception or not."""
        self._check_open("Engine.record")
        missing = [m for m in ("step", "record") if not callable(getattr(recorder, m, None))]
        if missing:
            raise TypeError(f"Engine.record: the recorder needs the methods step(view) and record(name, value, "
                            f"rows) (bitmatch.tracing.Recorder has both); {type(recorder).__name__} lacks {missing}")
        runner = self.model_runner
        runner.recorders.append(recorder)
        try:
            yield recorder
        finally:
            recorders = runner.recorders
            del recorders[len(recorders) - 1 - recorders[::-1].index(recorder)]
            if not recorders and runner.graphs is not None:
                runner.graphs.drop_recording()

    # -- requests -------------------------------------------------------------------------
    def _request_seed(self, seed: int | None, index: int) -> int:
        """The seed keying the request's sampling noise (kernels.uniform_noise)."""
        if seed is None:  # derived from the engine seed and the request's index
            seed = xxhash.xxh64(f"{self.seed}:{index}".encode()).intdigest() >> 1
        return seed

    def add_request(self, prompt, sampling_params: SamplingParams | None = None) -> str:
        """Queue one request (token ids or, with a tokenizer, a string); returns its request id."""
        self._check_open("Engine.add_request")
        return self._add_request(prompt, sampling_params, "Engine.add_request: prompt",
                                 "Engine.add_request: sampling_params")

    def _add_request(self, prompt, sampling_params, where: str, sp_where: str) -> str:
        params = SamplingParams() if sampling_params is None else sampling_params
        check_sampling_params(params, sp_where)
        text = None
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"{where} is a string, which needs a tokenizer (Engine(model, tokenizer)); "
                                 "pass token-id lists otherwise")
            text, prompt = prompt, list(self.tokenizer.encode(prompt))
        else:
            prompt = token_ids(prompt, where)
        if len(prompt) == 0:
            raise ValueError(f"{where} must have at least one token, got an empty one")
        if self.max_model_len is not None and len(prompt) >= self.max_model_len:
            raise ValueError(f"{where} of {len(prompt)} tokens leaves no room under {self._len_limit} (prompt + "
                             "completion must fit): shorten or truncate the prompt")
        if min(prompt) < 0 or max(prompt) >= self.vocab_size:
            raise ValueError(f"{where}: token ids must be in [0, {self.vocab_size}), got "
                             f"min {min(prompt)} max {max(prompt)}")
        if not self.enable_chunked_prefill and len(prompt) > self.max_num_batched_tokens:
            raise ValueError(f"{where} of {len(prompt)} tokens exceeds max_num_batched_tokens="
                             f"{self.max_num_batched_tokens} with enable_chunked_prefill=False")
        # The longest K/V the request can need (the last sampled token is never written).
        need = -(-(len(prompt) + params.max_tokens - 1) // self.block_size)
        if need > self.num_gpu_blocks:
            raise ValueError(f"Engine: request needs up to {need} KV blocks (prompt {len(prompt)} + max_tokens "
                             f"{params.max_tokens}, block_size {self.block_size}) but the cache has "
                             f"num_gpu_blocks={self.num_gpu_blocks}: raise num_gpu_blocks/kv_cache_bytes "
                             "or lower max_tokens")
        index = self._num_requests
        self._num_requests += 1
        seq = Sequence(index, list(prompt), params, self._request_seed(params.seed, index), self.block_size, text)
        self._seqs[seq.request_id] = seq
        self.scheduler.add(seq)
        return seq.request_id

    def has_unfinished_requests(self) -> bool:
        return not self.scheduler.is_finished()

    def reset_prefix_cache(self) -> None:
        self.block_manager.reset_prefix_cache()

    def abort_all(self) -> None:
        """Drop every queued and running request and free their KV blocks."""
        for seq in list(self.scheduler.running) + list(self.scheduler.waiting):
            self.block_manager.deallocate(seq)
        self.scheduler.running.clear()
        self.scheduler.waiting.clear()
        self._seqs.clear()
        self._idle = True

    # -- weight versions --------------------------------------------------------------------
    @property
    def weight_state(self):
        """The receiver's WeightState managing this engine's model (None: no receiver)."""
        return weight_state(self.model) or weight_state(self._lm)

    def _holding_weights(self):
        """One step's hold on the weights (``weights.holding_weights``): (version, fingerprint) of the
        verified weights under a receiver, (None, None) for a model no receiver manages."""
        return holding_weights(self.weight_state, self.quantization, self._digests)

    def weights_written_since_sampling(self) -> list[str]:
        """The parameters and buffers written in place (or replaced) since the engine last started
        sampling (its first step after being idle): with weights shared with a trainer, a non-empty
        list explains a rollout / trainer mismatch that no op of a forward shows (the weights changed
        between sampling and scoring). Empty before any step."""
        return written_since(self.sampled_weights, self.model)

    # -- stepping -------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule, run and sample one step; returns the requests that finished in it."""
        self._check_open("Engine.step")
        with self._holding_weights() as (version, fp):
            return self._step(version, fp)

    def _step(self, version, fp) -> list[RequestOutput]:
        scheduled = self.scheduler.schedule()
        if not scheduled:
            return []
        if self._idle:  # first step after idle: weights derived from the parameters are rebuilt
            self._idle = False
            self.sampled_weights = weight_versions(self.model)
            self.model_runner.weights_changed = True
            with torch.no_grad():
                self._family.refresh_derived_weights(self._lm, force=True)
        for seq, _ in scheduled:
            if seq.weight_version is None and not seq.token_ids[seq.num_prompt_tokens:]:
                seq.weight_version, seq.weight_fingerprint = version, fp
            elif (seq.weight_version, seq.weight_fingerprint) != (version, fp):
                self.abort_all()
                raise WeightVersionError(
                    f"Engine: the weights switched from version {seq.weight_version} to {version} while request "
                    f"{seq.request_id} was running (its tokens would mix two versions); publish between "
                    "generate() calls, not during one. All running requests were aborted")
        seqs, tokens, lps, sampled = self.model_runner.run(scheduled)
        self._refuse_nan(seqs, lps)
        for seq, n in scheduled:
            seq.num_computed_tokens += n
            self.block_manager.mark_computed(seq)
        finished = []
        for seq, tok, lp, slp in zip(seqs, tokens, lps, sampled):
            seq.append_token(tok, lp, slp)
            sp = seq.params
            if tok in sp.stop_token_ids or (not sp.ignore_eos and tok in self.eos_token_ids):
                self.scheduler.finish(seq, "stop", tok)
            elif seq.num_completion_tokens >= sp.max_tokens or (
                    self.max_model_len is not None and len(seq) >= self.max_model_len):
                self.scheduler.finish(seq, "length")
            else:
                continue
            finished.append(RequestOutput.from_seq(self._seqs.pop(seq.request_id), self.tokenizer))
        if self.scheduler.is_finished():
            self._idle = True
        return finished

    def _refuse_nan(self, seqs: list[Sequence], lps: list[float]) -> None:
        """A NaN logprob means logits / T was not finite in float32 (a temperature too small for these
        logits, or NaN logits): the token was drawn from garbage weights, so nothing of it is kept."""
        bad = [seq for seq, lp in zip(seqs, lps) if lp != lp]
        if not bad:
            return
        seq = bad[0]
        self.abort_all()
        t = seq.params.temperature
        cause = ("the model's logits are NaN (greedy rows are scored at T = 1): check its weights" if t == 0.0 else
                 f"its logits divided by temperature={t!r} are not finite in float32: raise the temperature (or, "
                 "if the logits are NaN at temperature=1.0 too, check the model's weights)")
        raise ValueError(f"Engine: request {seq.request_id} (and {len(bad) - 1} more in this step) sampled a token "
                         f"with a NaN logprob: {cause}. All running requests were aborted")

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate for every prompt (token-id lists or strings); outputs in input order."""
        self._check_open("Engine.generate")
        prompts, params = batch_requests(prompts, sampling_params)
        if self.has_unfinished_requests():
            raise RuntimeError("Engine.generate: requests added with add_request are still running; "
                               "step() them to completion first")
        with self._holding_weights():  # refuse before queueing anything: no verified version yet
            pass
        self.reset_prefix_cache()  # the weights may have changed since the last call
        try:
            ids = [self._add_request(p, sp, f"Engine.generate: prompts[{i}]", f"Engine.generate: sampling_params[{i}]")
                   for i, (p, sp) in enumerate(zip(prompts, params))]
        except Exception:  # a bad prompt: drop the ones queued before it
            self.scheduler.waiting.clear()
            self._seqs.clear()
            raise
        from tqdm.auto import tqdm
        bar = tqdm(total=len(ids), desc="bitmatch generate", disable=not (use_tqdm and len(ids) > 1))
        done: dict[str, RequestOutput] = {}
        # data-parallel experts (bitmatch.parallel.enable_expert_parallel): every rank's engine runs each
        # MoE layer's collectives, so the ranks step together until none has a request left
        together = tp_step(self._lm)
        try:
            while together is not None or self.has_unfinished_requests():
                outs = self.step() if together is None else together(self)
                if outs is None:
                    break
                for out in outs:
                    done[out.request_id] = out
                    bar.update(1)
        except BaseException:  # weights not ready / switched mid-request / interrupted: leave no request behind
            self.abort_all()
            raise
        finally:
            bar.close()
        return [done[i] for i in ids]
