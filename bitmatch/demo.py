"""What ``bitmatch demo`` runs (``run``; the command's options: ``bitmatch.cli.demo``): rollout
logprobs vs trainer logprobs, with and without bitmatch.

1. A tiny Qwen3-style model (random weights, fixed seed, bf16, head_dim 64) and a character
   tokenizer built in code (or the ``model`` given: ``bitmatch demo --model PATH_OR_NAME``).
2. Rollouts with ``bitmatch.Engine`` under varied batch compositions (groups of different
   sizes, different ``max_num_seqs``, block sizes, chunked prefill on/off).
3. The trainer recomputes every sampled token's logprob on one padded batch of a different
   size and order with ``bitmatch.token_logprobs``: Diff = 0, KL = 0.
4. The same tokens with bitmatch off: the rollout side is the stock HF forward with its KV
   cache, decoding token by token in the rollout's groups; the trainer side the stock HF
   forward on the padded training batch; both ``log_softmax(logits.float() / T)``.
Writes ``report.json`` and ``diff.png`` (per-token |diff|) to ``out_dir``.
"""
from __future__ import annotations

import json
import os
import time

import torch

from bitmatch.diagnostics.verify import compare
from bitmatch.engine import Engine, SamplingParams
from bitmatch.logprobs import token_logprobs
from bitmatch.testing.models import CharTokenizer, pad_batch, tiny_model

PROMPTS = [
    "The quick brown fox", "Hello", "In the beginning", "def f(x):", "1 + 1 =", "Once upon a time there was",
    "a", "RL needs on-policy logprobs", "bits", "The trainer and the engine agree", "Q:", "import torch",
    "Diff = 0", "KL", "Why do logprobs differ between engines?", "x",
]


def _stock_decode_logprobs(model, groups, seqs, prompt_lens, temperature):
    """Stock HF rollout side: per group, left-padded prefill with the KV cache, then one token at
    a time (teacher-forced on the sampled tokens), as an HF-based rollout engine computes them."""
    from transformers import DynamicCache

    dev = next(model.parameters()).device
    out = {}
    # transformers >= 5.2x renamed forward's past_key_values to cache (the old name warns): use the
    # name this model's forward declares
    import inspect
    cache_kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    with torch.no_grad():
        for g in groups:
            P = max(prompt_lens[i] for i in g)
            C = max(len(seqs[i]) - prompt_lens[i] for i in g)
            ids = torch.zeros((len(g), P), dtype=torch.long)
            mask = torch.zeros((len(g), P), dtype=torch.long)
            for r, i in enumerate(g):
                p = seqs[i][:prompt_lens[i]]
                ids[r, P - len(p):] = torch.tensor(p)
                mask[r, P - len(p):] = 1
            ids, mask = ids.to(dev), mask.to(dev)
            pos = (mask.cumsum(-1) - 1).clamp(min=0)
            cache = DynamicCache(config=model.config)
            res = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True, **{cache_kw: cache})
            lps = [[] for _ in g]
            logits = res.logits[:, -1]
            for j in range(C):
                tok = torch.tensor([seqs[i][prompt_lens[i] + j] if prompt_lens[i] + j < len(seqs[i]) else 0
                                    for i in g], device=dev)
                lp = torch.log_softmax(logits.float() / temperature, dim=-1).gather(-1, tok[:, None])[:, 0]
                for r, i in enumerate(g):
                    if prompt_lens[i] + j < len(seqs[i]):
                        lps[r].append(float(lp[r]))
                if j == C - 1:
                    break
                mask = torch.cat([mask, torch.ones((len(g), 1), dtype=mask.dtype, device=dev)], 1)
                pos = mask.sum(-1, keepdim=True) - 1
                res = model(input_ids=tok[:, None], attention_mask=mask, position_ids=pos, use_cache=True,
                            **{cache_kw: cache})
                logits = res.logits[:, -1]
            for r, i in enumerate(g):
                out[i] = lps[r]
    return [out[i] for i in range(len(seqs))]


def _stock_trainer_logprobs(model, batch_ids, mask, temperature):
    with torch.no_grad():
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        logits = model(input_ids=batch_ids, attention_mask=mask, position_ids=pos).logits
        lp = torch.log_softmax(logits[:, :-1].float() / temperature, dim=-1)
        return lp.gather(-1, batch_ids[:, 1:, None])[..., 0]


def _plot(path, diffs_on, diffs_off, title):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 3.6), dpi=110)
    xs = list(range(len(diffs_off)))
    ax.plot(xs, diffs_off, ".", ms=3, color="tab:red",
            label=f"bitmatch off (stock HF): {sum(d != 0 for d in diffs_off)} / {len(diffs_off)} differ")
    ax.plot(list(range(len(diffs_on))), diffs_on, ".", ms=3, color="tab:green",
            label=f"bitmatch on: {sum(d != 0 for d in diffs_on)} / {len(diffs_on)} differ")
    ax.set_yscale("symlog", linthresh=1e-7)
    ax.set_xlabel("sampled token (all rollouts, in order)")
    ax.set_ylabel("|trainer - rollout| logprob")
    ax.set_title(title)
    ax.legend(loc="center right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def run(model=None, tokenizer=None, *, out_dir="bitmatch-demo", num_prompts=12, max_tokens=8, temperature=0.9,
        seed=0, quiet=False, plot=True) -> dict:
    """Roll out ``num_prompts`` requests on ``bitmatch.Engine`` in three batch compositions, rescore
    them as a trainer does, with bitmatch and with stock HF, and return the report (written to
    ``out_dir`` unless it is empty): with bitmatch the trainer's logprobs equal the rollout's bit for
    bit, whatever the batch, block size or chunking (``report["bitmatch_on"]["bitmatched"]``)."""
    say = (lambda *a: None) if quiet else (lambda *a: print(*a, flush=True))
    t0 = time.time()
    torch.manual_seed(seed)
    if model is None:
        model = tiny_model("qwen3-hd64-gqa4-tied", dtype=torch.bfloat16, seed=seed, attn_implementation="sdpa")
        tokenizer = CharTokenizer()
        name = "tiny Qwen3-style (random weights, bf16, 2 layers, head_dim 64)"
    else:
        name = getattr(model.config, "_name_or_path", None) or type(model).__name__
    texts = [PROMPTS[i % len(PROMPTS)] for i in range(num_prompts)]
    if tokenizer is not None:
        prompts = [list(tokenizer.encode(t)) for t in texts]
    else:
        prompts = [[1 + (7 * i + j) % 90 for j in range(1 + i % 9)] for i in range(num_prompts)]
    sps = [SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=seed * 1000 + i, ignore_eos=True)
           for i in range(num_prompts)]

    # rollouts: varied batch compositions and schedules
    say(f"bitmatch demo: {name}")
    cuts = [1, 4]
    groups, a = [], 0
    for c in cuts + [num_prompts]:
        if a >= num_prompts:
            break
        groups.append(list(range(a, min(num_prompts, a + c))))
        a += c
    configs = [dict(max_num_seqs=1, block_size=16), dict(max_num_seqs=4, block_size=32, enable_chunked_prefill=False),
               dict(max_num_seqs=64, block_size=16, max_num_batched_tokens=24)]
    completions = [None] * num_prompts
    roll_lp = [None] * num_prompts
    for g, cfg in zip(groups, configs):
        need = sum(-(-(len(prompts[i]) + max_tokens) // cfg["block_size"]) for i in g)
        eng = Engine(model, tokenizer, seed=seed, num_gpu_blocks=need + 4, **cfg)
        outs = eng.generate([prompts[i] for i in g], [sps[i] for i in g], use_tqdm=False)
        for i, o in zip(g, outs):
            completions[i] = list(o.outputs[0].token_ids)
            roll_lp[i] = list(o.outputs[0].logprobs)
    t_roll = time.time() - t0
    seqs = [p + c for p, c in zip(prompts, completions)]
    plens = [len(p) for p in prompts]

    # trainer: one padded batch, different size and order (reversed, right padding)
    order = list(reversed(range(num_prompts)))
    ids, mask = pad_batch([seqs[i] for i in order], "right")
    dev = next(model.parameters()).device
    ids, mask = ids.to(dev), mask.to(dev)
    with torch.no_grad():
        lp = token_logprobs(model, ids, mask, temperature=temperature).cpu()
    train_lp = [None] * num_prompts
    for r, i in enumerate(order):
        train_lp[i] = lp[r, plens[i] - 1: len(seqs[i]) - 1].tolist()
    on = compare(roll_lp, train_lp)
    t_on = time.time() - t0

    # bitmatch off: stock HF rollout (KV-cache decode in the same groups) vs stock HF trainer batch
    off_roll = _stock_decode_logprobs(model, groups, seqs, plens, temperature)
    slp = _stock_trainer_logprobs(model, ids, mask, temperature).cpu()
    off_train = [None] * num_prompts
    for r, i in enumerate(order):
        off_train[i] = slp[r, plens[i] - 1: len(seqs[i]) - 1].tolist()
    off = compare(off_roll, off_train)
    t_all = time.time() - t0

    def row(label, c):
        return (f"  {label:<22} {c.total:>8} {c.mismatches:>11} {c.max_abs_diff:>12.3g} {c.mean_abs_diff:>12.3g} "
                f"{c.k3_kl:>10.3g}")

    say(f"rollouts: {num_prompts} requests in batches of {[len(g) for g in groups]} "
        f"(max_num_seqs 1/4/64, block sizes 16/32, chunked prefill on/off, 24-token step budget), "
        f"{max_tokens} tokens each, T={temperature}")
    say(f"trainer : one right-padded batch of {num_prompts} sequences (reversed order), bitmatch.token_logprobs")
    say(f"  {'':<22} {'tokens':>8} {'mismatches':>11} {'max |diff|':>12} {'mean |diff|':>12} {'k3 KL':>10}")
    say(row("bitmatch on", on))
    say(row("bitmatch off (HF)", off))
    say(f"bitmatch on : Diff = {on.max_abs_diff:g}, KL = {on.k3_kl:g}  ->  "
        f"{'BITMATCHED' if on.bitmatched else 'MISMATCH: ' + on.summary()}")
    say(f"bitmatch off: {off.mismatches} of {off.total} tokens differ (max |diff| {off.max_abs_diff:.3g})")
    report = {
        "model": name, "num_prompts": num_prompts, "max_tokens": max_tokens, "temperature": temperature,
        "rollout_batches": [len(g) for g in groups], "engine_configs": configs,
        "bitmatch_on": on.to_dict(), "bitmatch_off": off.to_dict(),
        "per_token_abs_diff_on": on.abs_diffs, "per_token_abs_diff_off": off.abs_diffs,
        "seconds": {"rollout": round(t_roll, 3), "through_trainer": round(t_on, 3), "total": round(t_all, 3)},
    }
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, "report.json"), "w") as f:
            json.dump(report, f, indent=1)
        wrote = [os.path.join(out_dir, "report.json")]
        if plot:
            try:
                _plot(os.path.join(out_dir, "diff.png"), on.abs_diffs, off.abs_diffs,
                      "rollout vs trainer logprob, per sampled token")
                wrote.append(os.path.join(out_dir, "diff.png"))
            except ImportError:
                say("(matplotlib not installed: no diff.png; pip install bitmatch[plot], or pass --no-plot)")
        say("wrote " + " and ".join(wrote))
    return report
