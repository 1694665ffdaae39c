"""TRL GRPO step time: stock TRL vs ``bitmatch.adapters.trl.attach``, with and without LoRA, side by side.

Four runs in one process, each a fresh ``GRPOTrainer`` on the same random-weight Qwen3 (fp32 master
weights, ``bf16=True`` mixed precision on CUDA), the same seed and the same toy task
(``bitmatch.testing.trl``: character tokenizer, one-letter prompts, the toy reward):

  stock        stock TRL, ``use_vllm=False`` (HF ``generate``)
  attach       ``attach(GRPOTrainer(...))``: ``bitmatch.Engine`` rollouts, Diff checked every step
  stock_lora   stock TRL with a PEFT LoRA config (r 8, all linear projections)
  attach_lora  ``attach`` with the same LoRA config (default rollout: the engine on the policy, LoRA
               layers on kept merged weights)
  attach_lora_copy  the same with ``rollout_weights="copy"`` (a rollout copy updated through
               ``bitmatch.sync.publish``)
  attach_lora_gencheck  attach_lora with the Diff check on a separate trainer forward right after
               the rollout (``check_at="generation"``) instead of the loss's own logprobs

A step is one optimizer step (one generation of prompts x generations completions, then
fwd+bwd): wall time from the previous step's end (the first: from train begin), the device
drained at both ends. The first step is reported apart (it pays the Triton compiles and the
engine's construction); the figure is the median of the steps after it. Also per step:
``trainer._generate`` (the rollout), for attached runs the adapter's ``sync_rollout`` and the
rollout copy's send inside it (through ``RolloutCopy.sender``; from the second step), and the
Diff metrics the adapter logs (``bitmatch/mismatch_tokens``, ``bitmatch/compared_tokens``; the
mismatch count must be 0).

  python benchmarks/adapters/trl_step.py --device cpu --smoke                # tiny, CPU, < 2 min
  python benchmarks/adapters/trl_step.py --out DIR [--tied] [--steps 5]      # H200: writes DIR/trl_step_h200.json

Runs from outside the checkout too (the installed bitmatch; the toy task is read from the
``examples/`` folder beside this file). Needs trl, datasets and peft (``pip install bitmatch[trl]``).
Exit status 1 if a run failed or a step reported a mismatch (the JSON is written first).
"""
from __future__ import annotations

import argparse
import copy
import gc
import importlib.metadata as md
import json
import os
import pathlib
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import traceback

import torch
from transformers import TrainerCallback

import bitmatch
import bitmatch.adapters.trl
import bitmatch.sync
import bitmatch.testing.trl as ttrl
from bitmatch.testing.models import tiny_model

REPO = pathlib.Path(__file__).resolve().parents[2]
RUNS = ("stock", "attach", "stock_lora", "attach_lora", "attach_lora_copy", "attach_lora_gencheck")
PAIRS = (("attach", "stock"), ("attach_lora", "stock_lora"), ("attach_lora_copy", "stock_lora"),
         ("attach_lora_gencheck", "stock_lora"), ("attach_lora", "attach"))
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

# model shape and step size: the GPU default, and the CPU smoke
FULL = dict(model=dict(hidden_size=1024, num_hidden_layers=12, num_attention_heads=16, num_key_value_heads=8,
                       head_dim=64, intermediate_size=3072, vocab_size=151936, initializer_range=0.02),
            prompts=32, generations=8, tokens=48, steps=5, micro_batch=64)
SMOKE = dict(model=dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                        head_dim=64, intermediate_size=128, vocab_size=128),
             prompts=4, generations=2, tokens=8, steps=2, micro_batch=8)


# ----------------------------------------------------------------------------- timing

def drain(device):
    if device == "cuda":
        torch.cuda.synchronize()


def timed(fn, device, box: dict, step_of):
    """``fn`` wrapped: the device drained before and after, wall seconds added to ``box[step_of()]``."""
    def wrapper(*args, **kwargs):
        drain(device)
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            drain(device)
            k = step_of()
            box[k] = box.get(k, 0.0) + time.perf_counter() - t
    wrapper.__wrapped__ = fn
    return wrapper


class TimedSender:
    """The rollout copy's in-process sender with each send timed as ``timed`` does: what
    ``RolloutCopy.sender`` takes in place of the copy's receiver."""

    def __init__(self, receiver, device, box: dict, step_of):
        self._send = timed(bitmatch.sync.InProcessSender(receiver).send, device, box, step_of)

    def send(self, model, version, dtype):
        return self._send(model, version, dtype)


class StepTimer(TrainerCallback):
    """Each optimizer step's wall seconds in ``steps``: from the previous step's end (the first:
    from train begin) to this one's, the device drained at both ends."""

    def __init__(self, device):
        self.device, self.steps, self.t = device, [], None

    def on_train_begin(self, args, state, control, **kwargs):
        drain(self.device)
        self.t = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        drain(self.device)
        now = time.perf_counter()
        self.steps.append(now - self.t)
        self.t = now


class StepProfiler(TrainerCallback):
    """torch profiler over optimizer step ``at`` (a steady one): the top CUDA kernels by device
    time and the top host ops by self CPU time, in ``result``."""

    def __init__(self, at: int, k: int = 15):
        self.at, self.k, self.prof, self.result = at, k, None, None

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step == self.at and self.prof is None:
            from torch.profiler import ProfilerActivity, profile
            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
            self.prof = profile(activities=acts)
            self.prof.__enter__()

    def on_step_end(self, args, state, control, **kwargs):
        if self.prof is None or self.result is not None:
            return
        drain("cuda" if torch.cuda.is_available() else "cpu")
        self.prof.__exit__(None, None, None)
        ev = self.prof.key_averages()
        dev = lambda e: getattr(e, "self_device_time_total", 0) or 0  # noqa: E731
        gpu = sorted((e for e in ev if dev(e) > 0), key=dev, reverse=True)
        cpu = sorted(ev, key=lambda e: e.self_cpu_time_total, reverse=True)
        self.result = {
            "step": self.at, "kernel_ms": round(sum(dev(e) for e in ev) / 1e3, 2),
            "host_self_ms": round(sum(e.self_cpu_time_total for e in ev) / 1e3, 2),
            "top_kernels": [{"ms": round(dev(e) / 1e3, 2), "calls": e.count, "name": e.key[:80]} for e in gpu[:self.k]],
            "top_host": [{"self_ms": round(e.self_cpu_time_total / 1e3, 2), "calls": e.count, "name": e.key[:80]}
                         for e in cpu[:self.k]],
            "phases": phases(self.prof.events(), GENERATE_RANGE, self.k)}


GENERATE_RANGE = "trl_step.generate"


def phases(events, marker: str, k: int) -> dict:
    """The profiled step split at the ``marker`` range (trainer._generate, drained at its end):
    per phase the kernel time (device events only: an op's and its kernels' times are not both
    counted), the host self time, and the top kernels and host ops. An event is in the phase its
    start falls in (a kernel of the generation runs before the drain that ends the range)."""
    spans = [(e.time_range.start, e.time_range.end) for e in events if e.name == marker]
    if not spans:
        return {}
    sums = {phase: ({}, {}) for phase in ("generate", "rest")}   # phase -> (device, host) name -> [us, calls]
    for e in events:   # one pass: a profile holds ~10^5 events
        if e.name == marker:
            continue
        phase = "generate" if any(a <= e.time_range.start <= b for a, b in spans) else "rest"
        cpu = e.device_type == torch.autograd.DeviceType.CPU
        c = sums[phase][cpu].setdefault(e.name, [0.0, 0])
        c[0] += e.self_cpu_time_total if cpu else e.device_time_total
        c[1] += 1

    def top(d):
        return [{"ms": round(v[0] / 1e3, 2), "calls": v[1], "name": n[:80]}
                for n, v in sorted(d.items(), key=lambda kv: -kv[1][0])[:k]]
    return {phase: {"kernel_ms": round(sum(v[0] for v in dev.values()) / 1e3, 2),
                    "kernels": sum(v[1] for v in dev.values()),
                    "host_self_ms": round(sum(v[0] for v in host.values()) / 1e3, 2),
                    "top_kernels": top(dev), "top_host": top(host)}
            for phase, (dev, host) in sums.items()}


def marked(fn, name: str):
    """``fn`` inside a profiler range named ``name`` (free when no profiler runs)."""
    def wrapper(*args, **kwargs):
        with torch.profiler.record_function(name):
            return fn(*args, **kwargs)
    return wrapper


def per_step(box: dict, steps: int):
    return [round(box.get(i, 0.0), 4) for i in range(steps)]


def median_after_first(xs):
    return round(statistics.median(xs[1:]), 4) if len(xs) > 1 else None


# ----------------------------------------------------------------------------- one run

def policy(a, shape):
    """The random-weight Qwen3 of every run (fp32 master weights, seed 0)."""
    m = tiny_model("qwen3", dtype=torch.float32, seed=0, attn_implementation=a.attn,
                   tie_word_embeddings=a.tied, **shape["model"])
    m.train()
    return m


def use_checkout_examples():
    """``bitmatch.testing.trl`` reads its toy task from ``examples/`` beside the package; an
    installed bitmatch has none, so point it at the checkout this file is in."""
    if not (ttrl.EXAMPLES / "trl_grpo.py").is_file():  # site-packages/examples may exist (other packages)
        ttrl.EXAMPLES = REPO / "examples"


def run_one(name, a, shape, base, workdir):
    """One fresh trainer, ``steps`` optimizer steps; a dict of per-step times and Diff metrics."""
    lora, attached = "_lora" in name, name.startswith("attach")
    peft_config = None
    if lora:
        from peft import LoraConfig
        peft_config = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, task_type="CAUSAL_LM",
                                 target_modules=LORA_TARGETS)
    n_gen = shape["prompts"] * shape["generations"]
    micro = min(shape["micro_batch"], n_gen)
    cuda = a.device == "cuda"
    torch.manual_seed(0)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    t_build = time.perf_counter()
    trainer = ttrl.grpo_trainer(
        copy.deepcopy(base), os.path.join(workdir, name), a.steps, dataset_size=shape["prompts"] * a.steps,
        peft_config=peft_config, use_cpu=not cuda, bf16=cuda, learning_rate=a.lr,
        per_device_train_batch_size=micro, gradient_accumulation_steps=n_gen // micro,
        num_generations=shape["generations"], max_completion_length=shape["tokens"])
    if attached:
        trainer = bitmatch.adapters.trl.attach(trainer, on_mismatch="log", engine_kwargs=a.engine_kwargs,
                                               rollout_weights="copy" if name.endswith("_copy") else "auto")
        if name.endswith("_gencheck"):
            trainer._bitmatch.check_at = "generation"
    build_s = time.perf_counter() - t_build

    def step_of():
        return trainer.state.global_step

    gen, sync, pub, check = {}, {}, {}, {}
    timer = StepTimer(a.device)
    trainer.add_callback(timer)
    profiler = StepProfiler(a.profile_step) if a.profile_step is not None else None
    if profiler is not None:
        trainer.add_callback(profiler)
    # _generate is not one of the methods attach rebinds
    trainer._generate = timed(marked(trainer._generate, GENERATE_RANGE), a.device, gen, step_of)
    if attached:
        bm = trainer._bitmatch
        sync_rollout = bm.sync_rollout

        def sync_rollout_publish_timed():
            # the rollout copy publishes through a timing sender (RolloutCopy.sender) once it exists:
            # the first step builds the copy and publishes in one call, so its publish is not timed
            copy = bm.rollout_copy
            if copy is not None and copy.sender is None:
                copy.sender = TimedSender(copy.receiver, a.device, pub, step_of)
            return sync_rollout()
        bm.sync_rollout = timed(sync_rollout_publish_timed, a.device, sync, step_of)
        # the Diff check: at generation a trainer forward (check_at="generation"), or the collection
        # of the loss's logprobs and the comparison (check_at="loss")
        bm.compare_step = timed(bm.compare_step, a.device, check, step_of)
        bm.collect = timed(bm.collect, a.device, check, step_of)
    out = {"run": name, "lora": lora, "bitmatch": attached, "build_s": round(build_s, 3)}
    try:
        trainer.train()
    except Exception as e:  # recorded, and the other runs go on
        out["error"] = f"{type(e).__name__}: {e}"[:2000]
        out["traceback_tail"] = traceback.format_exc()[-4000:]
        print(f"[{name}] FAILED: {out['error'][:300]}", flush=True)
    if profiler is not None:
        out["profile"] = profiler.result
    steps = [round(s, 4) for s in timer.steps]
    out.update(steps_done=len(steps), step_s=steps, first_step_s=steps[0] if steps else None,
               median_step_s=median_after_first(steps), generate_s=per_step(gen, len(steps)))
    out["median_generate_s"] = median_after_first(out["generate_s"])
    # the rest of a step: the trainer's forwards and backward, the optimizer, the Diff check
    out["rest_s"] = [round(s - g, 4) for s, g in zip(steps, out["generate_s"])]
    out["median_rest_s"] = median_after_first(out["rest_s"])
    if attached:
        out.update(sync_rollout_s=per_step(sync, len(steps)), publish_s=per_step(pub, len(steps)))
        if name.endswith("_copy") and steps:
            out["publish_s"][0] = None   # built and published in one call: not timed
        out["median_sync_rollout_s"] = median_after_first(out["sync_rollout_s"])
        out["median_publish_s"] = median_after_first(out["publish_s"])
        out["check_s"] = per_step(check, len(steps))
        out["median_check_s"] = median_after_first(out["check_s"])
        out["rollout_weights"] = trainer._bitmatch.rollout_weights
        out["compute_dtype"] = str(trainer._bitmatch.compute_dtype)
        hist = trainer.state.log_history
        out["mismatch_tokens"] = [h["bitmatch/mismatch_tokens"] for h in hist if "bitmatch/mismatch_tokens" in h]
        out["compared_tokens"] = [h["bitmatch/compared_tokens"] for h in hist if "bitmatch/compared_tokens" in h]
        out["diff_max"] = [h["bitmatch/diff_max"] for h in hist if "bitmatch/diff_max" in h]
        out["checked_steps"] = len(trainer._bitmatch.history)
    out["reward"] = [round(h["reward"], 4) for h in trainer.state.log_history if "reward" in h]
    if cuda:
        out["peak_mem_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    release(trainer)
    trainer = None  # not del: step_of reads trainer
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
        out["mem_after_release_gib"] = round(torch.cuda.memory_allocated() / 2**30, 2)
    return out


def release(trainer):
    """Drop what a finished run holds on the device, so the next run starts from the same free
    memory (the engine sizes its KV cache from what is free: 0.9 of the device by default)."""
    bm = getattr(trainer, "_bitmatch", None)
    if bm is not None:
        bm.engine = bm.rollout_model = bm.receiver = None
    trainer.accelerator.free_memory()
    trainer.model = trainer.model_wrapped = trainer.optimizer = trainer.lr_scheduler = None


def diff_ok(r):
    """The run finished, and every step it ran was checked with tokens compared and 0 mismatches."""
    if "error" in r or r["steps_done"] == 0:
        return False
    if not r["bitmatch"]:
        return True
    return (len(r["mismatch_tokens"]) == r["steps_done"] == r["checked_steps"]
            and all(m == 0 for m in r["mismatch_tokens"]) and all(c > 0 for c in r["compared_tokens"]))


# ----------------------------------------------------------------------------- report

def versions():
    out = {"python": platform.python_version(), "bitmatch": bitmatch.__version__}
    for pkg in ("torch", "transformers", "trl", "peft", "accelerate", "datasets", "triton"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            out[pkg] = None
    out["cuda"] = torch.version.cuda
    try:
        out["bitmatch_commit"] = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True,
                                                text=True, timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        out["bitmatch_commit"] = None
    return out


def machine(device):
    out = {"platform": platform.platform(), "cores": os.cpu_count(), "torch_threads": torch.get_num_threads()}
    if device == "cuda":
        out["gpu"] = torch.cuda.get_device_name(0)
        out["gpu_mem_gib"] = round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
    return out


def print_table(rows):
    def f(x):
        return "-" if x is None else f"{x:.3f}"

    print(f"\n{'run':<12} {'first s':>8} {'step s':>8} {'gen s':>8} {'rest s':>8} {'check s':>8} {'sync s':>8} "
          f"{'publish s':>9}  mismatches / compared")
    for r in rows:
        if "error" in r:
            mm = "FAILED: " + r["error"][:120]
        else:
            mm = f"{r['mismatch_tokens']} / {r['compared_tokens']}" if r["bitmatch"] else "(stock: not checked)"
        print(f"{r['run']:<12} {f(r['first_step_s']):>8} {f(r['median_step_s']):>8} {f(r['median_generate_s']):>8} "
              f"{f(r.get('median_rest_s')):>8} {f(r.get('median_check_s')):>8} {f(r.get('median_sync_rollout_s')):>8} "
              f"{f(r.get('median_publish_s')):>9}  {mm}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--smoke", action="store_true", help="tiny model and step (hidden 64, 2 layers, vocab 128, "
                    "4 prompts x 2 generations x 8 tokens, 2 steps)")
    ap.add_argument("--tied", action="store_true", help="tie the LM head to the embedding (default untied)")
    ap.add_argument("--steps", type=int, default=None, help="optimizer steps per run (default 5; smoke 2)")
    ap.add_argument("--runs", default=",".join(RUNS), help=f"subset of {','.join(RUNS)}")
    ap.add_argument("--attn", default="sdpa", choices=("sdpa", "eager"), help="HF attention of the stock runs")
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--engine-kwargs", type=json.loads, default={}, help="JSON dict for bitmatch.Engine via attach")
    ap.add_argument("--out", default=None, help="folder for the JSON (default: benchmarks/results)")
    ap.add_argument("--profile-step", type=int, default=None,
                    help="torch-profile this optimizer step of each run (top kernels and host ops in the JSON)")
    a = ap.parse_args(argv)
    if a.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("trl_step: --device cuda but no CUDA device (use --device cpu --smoke)")
    runs = [r for r in a.runs.split(",") if r]
    if bad := [r for r in runs if r not in RUNS]:
        raise SystemExit(f"trl_step: unknown runs {bad}; choose from {RUNS}")
    shape = SMOKE if a.smoke else FULL
    a.steps = a.steps or shape["steps"]
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    use_checkout_examples()

    t0 = time.perf_counter()
    base = policy(a, shape)
    n_params = sum(p.numel() for p in base.parameters())
    print(f"policy: Qwen3 {shape['model']}, tied={a.tied}, {n_params / 1e6:.1f}M params; "
          f"{shape['prompts']} prompts x {shape['generations']} generations x {shape['tokens']} tokens, "
          f"{a.steps} steps, device {a.device}", flush=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="trl_step_") as workdir:
        for name in runs:
            t = time.perf_counter()
            try:
                r = run_one(name, a, shape, base, workdir)
            except Exception as e:  # building the trainer or attaching failed: recorded, the other runs go on
                r = {"run": name, "lora": "_lora" in name, "bitmatch": name.startswith("attach"),
                     "error": f"{type(e).__name__}: {e}"[:2000], "traceback_tail": traceback.format_exc()[-4000:],
                     "steps_done": 0, "first_step_s": None, "median_step_s": None, "median_generate_s": None}
            r["run_wall_s"] = round(time.perf_counter() - t, 2)
            rows.append(r)
            print(json.dumps({k: v for k, v in r.items() if k != "traceback_tail"}), flush=True)
    by = {r["run"]: r for r in rows}
    ratios = {}
    for num, den in PAIRS:
        if num in by and den in by and by[num]["median_step_s"] and by[den]["median_step_s"]:
            ratios[f"{num}/{den}"] = round(by[num]["median_step_s"] / by[den]["median_step_s"], 3)
    ok = all(diff_ok(r) for r in rows)
    print_table(rows)
    print("ratios (median step time):", ratios)
    print("Diff = 0 on every checked step, all runs finished:", ok)

    dev_name = "h200" if a.device == "cuda" else "cpu"
    out_path = pathlib.Path(a.out or REPO / "benchmarks" / "results") / \
        f"trl_step_{dev_name}{'_smoke' if a.smoke else ''}{'_tied' if a.tied else ''}.json"
    doc = {
        "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
        "machine": machine(a.device),
        "versions": versions(),
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "config": {"model": {**shape["model"], "tie_word_embeddings": a.tied, "params": n_params,
                             "attn_implementation": a.attn, "master_dtype": "float32",
                             "mixed_precision": "bf16" if a.device == "cuda" else "none (fp32)"},
                   "prompts": shape["prompts"], "generations": shape["generations"],
                   "max_completion_length": shape["tokens"], "steps": a.steps,
                   "micro_batch": min(shape["micro_batch"], shape["prompts"] * shape["generations"]),
                   "learning_rate": a.lr, "lora": {"r": 8, "alpha": 16, "targets": LORA_TARGETS},
                   "engine_kwargs": a.engine_kwargs, "gradient_checkpointing": False},
        "notes": "one process, runs in order; each a fresh GRPOTrainer on a deepcopy of the same random policy, "
                 "seed 0, the toy task of bitmatch.testing.trl (character tokenizer, prompts of 2 tokens, "
                 "completions run to max length: a random policy seldom samples EOS). step_s: wall seconds per "
                 "optimizer step (one generation + fwd/bwd over micro-batches), device drained at each step end; "
                 "median_* over steps after the first (the first pays Triton compiles, the engine build and, for "
                 "LoRA, the rollout copy; compiles done by an earlier run are not paid again). generate_s: "
                 "trainer._generate; sync_rollout_s / publish_s: the adapter's sync_rollout and the rollout "
                 "copy's send inside it (RolloutCopy.sender; null on the first step, which builds the copy and "
                 "publishes in one call), per step. Attached runs use on_mismatch='log'.",
        "results": rows,
        "ratios": ratios,
        "diff_zero_all_runs_ok": ok,
        "wall_s": round(time.perf_counter() - t0, 1),
    }
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(doc, indent=2))
    print(f"wrote {out_path}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
