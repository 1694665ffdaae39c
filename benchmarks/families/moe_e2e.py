"""Qwen3-MoE end to end: the engine vs the trainer (Diff), rollout and training speed vs HF, in one run.

Random-weight Qwen3-MoE, bf16 (default: 6 layers, hidden 2048, 32 heads, 4 kv heads, head_dim 128,
128 experts top-8, expert width 768, vocab 151936: Qwen3-30B-A3B's layer shape). Sections, in run
order (``--budget-s`` skips what would start too late; the JSON is rewritten after every
measurement, so a run cut short keeps what it measured):
- diff: bitmatch.Engine with its decode CUDA graphs on, two batch/schedule configs, vs
  bitmatch.token_logprobs on the same tokens (right-padded batches of 5, reversed order):
  mismatching tokens (want 0), with the graphs' captures and replays; the stock HF forward
  (fp32 log_softmax(logits / T)) as the control (want > 0).
- rollout: B in --batches, prompts of --prompt-len random tokens, --new-tokens sampled at T = 1
  (seeded per request): tokens/s and the median decode step of the engine with graphs, the same
  engine eager (and whether its tokens and logprobs equal the graphs' bit for bit), the same engine
  with HF's MoE block (Qwen3MoeSparseMoeBlock on HF's experts implementation, every other op
  bitmatch's) eager, and HF ``generate`` (SDPA, DynamicCache); host syncs of one decode step.
- train: one training step, fwd+bwd of ``token_logprobs`` on the patched model vs HF's own
  forward + backward (stock trainer: fp32 log_softmax(logits / T) at the next token) on the same
  weights, --train-shape tokens: step time, tokens/s, peak memory above the weights, top kernels.
- stock_graphs (last: a failed capture can leave the CUDA context unusable): the engine with HF's
  MoE block and graphs on.

  python benchmarks/families/moe_e2e.py --out DIR [--sections diff,rollout,train,stock_graphs]
      [--batches 32,64] [--budget-s 200]
  python benchmarks/families/moe_e2e.py --out DIR --device cpu --smoke    (tiny shapes: the script's logic;
      graphs simulated as in the CPU tests)

Writes DIR/moe_e2e.json (command, machine, versions, every figure).
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import os
import platform
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: _common, the groups
import _common
from training import gpu_train  # stock_token_logprobs, _peak

SMOKE = dict(hidden=64, layers=2, heads=2, kv_heads=1, head_dim=32, experts=8, top_k=2, inter=32, vocab=256,
             prompts=4, prompt_len=24, batches="2,4", new_tokens=4, diff_tokens=4, train_shape="2x16",
             rollout_prompt_len=16)


def build(a, device):
    import transformers

    cfg = transformers.Qwen3MoeConfig(
        vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=4 * a.hidden, num_hidden_layers=a.layers,
        num_attention_heads=a.heads, num_key_value_heads=a.kv_heads, head_dim=a.head_dim, num_experts=a.experts,
        num_experts_per_tok=a.top_k, moe_intermediate_size=a.inter, norm_topk_prob=True, decoder_sparse_step=1,
        max_position_embeddings=4096, initializer_range=0.02, router_aux_loss_coef=0.0, tie_word_embeddings=False)
    torch.manual_seed(a.seed)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # built in bf16 on the device: no fp32 copy on the host
    try:
        with torch.device(device):
            m = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    finally:
        torch.set_default_dtype(prev)
    return m.eval()


@contextlib.contextmanager
def hf_moe_block():
    """The engine's sparse layers on HF's own MoE block (its experts implementation)."""
    import bitmatch.models.qwen3_moe as qm
    orig = qm._moe_block
    qm._moe_block = lambda mod, x, dtype, rec=None, prefix="mlp": type(mod).forward(mod, x[None])[0]
    try:
        yield
    finally:
        qm._moe_block = orig


# ------------------------------------------------------------------ diff
# ------------------------------------------------------------------ rollout
def rollout(model, hf, a, device, rec, deadline):
    import bitmatch
    batches = [int(b) for b in a.batches.split(",")]
    Bmax, L, n_new = max(batches), a.rollout_prompt_len, a.new_tokens
    per_tok = 2 * a.layers * a.kv_heads * a.head_dim * 2
    kw = dict(max_num_seqs=Bmax, max_num_batched_tokens=Bmax * L + Bmax,
              kv_cache_bytes=int(Bmax * (L + n_new + 64) * per_tok * 1.2))
    graphs, eager = _common.engine(model, device, **kw), _common.engine(model, device, enforce_eager=True, **kw)

    def params(i):  # seeded per request: every engine draws the same noise for the same request
        return bitmatch.SamplingParams(temperature=1.0, max_tokens=n_new, ignore_eos=True, seed=i)

    def warm(i):
        return bitmatch.SamplingParams(temperature=1.0, max_tokens=2, ignore_eos=True, seed=i)
    out = rec.data["sections"].setdefault("rollout", {})
    for B in batches:
        if time.time() > deadline:
            out.setdefault("skipped_for_time", []).append(B)
            continue
        ids = torch.randint(0, a.vocab, (B, L), generator=torch.Generator().manual_seed(B))

        def stock_block(prompts, B=B):  # the same eager engine with HF's MoE block in its sparse layers
            with hf_moe_block():
                _common.engine_run(eager, prompts, warm)
                wall, steps, _ = _common.engine_run(eager, prompts, params)
            x = {"stock_moe_block_wall_s": wall, "stock_moe_block_decode_ms": _common.decode_ms(steps, n_new)}
            if B == Bmax:
                x["host_syncs_per_decode_step"] = {"graphs": _common.step_syncs(graphs, prompts, params),
                                                   "eager": _common.step_syncs(eager, prompts, params)}
            return x
        try:
            r = _common.rollout_row(graphs, eager, hf, ids, n_new, device, params, warm, extra=stock_block)
            r.update(stock_moe_block_tokens_per_s=B * n_new / r["stock_moe_block_wall_s"],
                     vs_stock_moe_block=r["stock_moe_block_wall_s"] / r["graphs_wall_s"],
                     eager_vs_stock_moe_block=r["stock_moe_block_wall_s"] / r["eager_wall_s"])
        except Exception:
            r = {"B": B, "error": traceback.format_exc()[-2000:]}
            print(r["error"], flush=True)
        out[f"B{B}"] = r
        print("rollout", {k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items() if k != "error"},
              flush=True)
        rec.flush()


def stock_graphs(model, a, device, rec):
    """The engine with HF's MoE block in its sparse layers and decode graphs on (captured with HF's
    block: its grouped_mm experts avoid host syncs by design), at the largest batch."""
    import bitmatch
    B, L, n_new = max(int(b) for b in a.batches.split(",")), a.rollout_prompt_len, a.new_tokens
    per_tok = 2 * a.layers * a.kv_heads * a.head_dim * 2
    prompts = torch.randint(0, a.vocab, (B, L), generator=torch.Generator().manual_seed(B)).tolist()
    r = {"B": B}
    with hf_moe_block(), torch.no_grad():
        eng = _common.engine(model, device, max_num_seqs=B, max_num_batched_tokens=B * L + B,
                     kv_cache_bytes=int(B * (L + n_new + 64) * per_tok * 1.2))
        warm = lambda i: bitmatch.SamplingParams(temperature=1.0, max_tokens=2, ignore_eos=True, seed=i)  # noqa: E731
        _common.engine_run(eng, prompts, warm)
        _common.engine_run(eng, prompts, warm)
        wall, steps, _ = _common.engine_run(eng, prompts, lambda i: bitmatch.SamplingParams(
            temperature=1.0, max_tokens=n_new, ignore_eos=True, seed=i))
    r.update(wall_s=wall, decode_ms=_common.decode_ms(steps, n_new), tokens_per_s=B * n_new / wall,
             graphs=_common.graph_use(eng))
    rec.put("stock_graphs", r)
    print("stock_graphs", r, flush=True)


# ------------------------------------------------------------------ train
def train(model, hf, a, device):
    B, L = (int(v) for v in a.train_shape.split("x"))
    res = gpu_train.train_compare(model, hf, B, L, a.vocab, device, syncs=a.train_syncs, host_profile=a.host_profile)
    res["hf_experts_implementation"] = getattr(hf.config, "_experts_implementation", None)
    return res


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (with --device cpu: the script's logic only)")
    ap.add_argument("--sections", default="diff,rollout,train,stock_graphs")
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--inter", type=int, default=768, help="expert width (moe_intermediate_size)")
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--prompts", type=int, default=20, help="diff: prompts of 8..--prompt-len tokens")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--diff-tokens", type=int, default=16)
    ap.add_argument("--batches", default="32,64")
    ap.add_argument("--rollout-prompt-len", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--train-shape", default="4x512")
    ap.add_argument("--train-syncs", action="store_true",
                    help="train: also count the host syncs of one step, stock and ours (torch's sync debug mode)")
    ap.add_argument("--host-profile", action="store_true",
                    help="train: also profile the host side of one step, stock and ours (cProfile)")
    ap.add_argument("--budget-s", type=float, default=200, help="no new section or batch after this many s")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    if a.smoke:
        explicit = {t.split("=")[0].lstrip("-").replace("-", "_") for t in (argv or sys.argv[1:]) if t.startswith("--")}
        for k, v in SMOKE.items():
            if k not in explicit:
                setattr(a, k, v)
    import transformers

    import bitmatch
    from bitmatch.engine.graphs import graph_safe
    from bitmatch.testing.models import random_prompts

    t_start = time.time()
    deadline = t_start + a.budget_s
    dev = torch.device(a.device)
    _common.DEV = dev.type  # gpu_train's helpers sync / measure memory on CUDA only
    os.makedirs(a.out, exist_ok=True)
    rec = _common.Recorder(os.path.join(a.out, "moe_e2e.json"), a, extra={
        "hostname": platform.node(), "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "bitmatch": bitmatch.__version__}})
    rec.data["command"] = " ".join([sys.executable] + sys.argv)
    hf = build(a, dev)
    model = bitmatch.patch(copy.deepcopy(hf))
    rec.data["hf_experts_implementation"] = getattr(hf.config, "_experts_implementation", None)
    rec.data["cuda_graph_safe"] = graph_safe(model)
    sections = a.sections.split(",")
    for name in sections:
        if time.time() > deadline:
            rec.data.setdefault("skipped_for_time", []).append(name)
            rec.flush()
            continue
        t0 = time.time()
        try:
            if name == "diff":
                prompts = random_prompts(a.prompts, 8, a.prompt_len, seed=1, vocab_hi=a.vocab - 1)
                rec.put("diff", _common.engine_diff(model, hf, prompts, dev, 0.9, a.diff_tokens))
            elif name == "rollout":
                rollout(model, hf, a, dev, rec, deadline)
            elif name == "train":
                rec.put("train", train(model, hf, a, dev))
            elif name == "stock_graphs":
                stock_graphs(model, a, dev, rec)
            else:
                raise ValueError(f"unknown section {name!r}")
        except Exception:
            rec.err(name)
        rec.data.setdefault("section_seconds", {})[name] = round(time.time() - t0, 1)
        rec.flush()
    rec.data["total_seconds"] = round(time.time() - t_start, 1)
    rec.flush()
    print("wrote", rec.path, "in", rec.data["total_seconds"], "s", flush=True)


if __name__ == "__main__":
    main()
