"""FP8 mode on the GPU: the FP8 engine vs token_logprobs in FP8 (Diff), and its decode step vs the bf16 engine's.

bitmatch.Engine's sampled-token logprobs (block-FP8 projections, CUDA graphs) vs bitmatch.token_logprobs
in FP8 mode on the same model, with the bf16 trainer as the control (want > 0); then 8B-shape decode
step time, FP8 engine vs bf16 engine, in one run.

  python benchmarks/engine/fp8_model.py --out DIR [--sections diff,speed] [--batches 64,256]
writes DIR/fp8_model.json (command, machine, versions, every row).
"""
import argparse
import copy
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: _common, the groups
import _common
import bitmatch

SMALL = dict(model_type="qwen3", hidden_size=1024, intermediate_size=3072, num_hidden_layers=6,
             num_attention_heads=16, num_key_value_heads=8, head_dim=128, vocab_size=32000,
             max_position_embeddings=4096, rms_norm_eps=1e-6, rope_theta=1e6, tie_word_embeddings=False)
QWEN3_8B = dict(SMALL, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                vocab_size=151936)
SMALL_MOE = dict(SMALL, model_type="qwen3_moe", moe_intermediate_size=384, num_experts=32, num_experts_per_tok=4,
                 norm_topk_prob=True, num_hidden_layers=4, num_key_value_heads=4, router_aux_loss_coef=0.0,
                 decoder_sparse_step=1, mlp_only_layers=[])
SMOKE = dict(SMALL, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=64, vocab_size=512)


def build(cfg: dict, seed: int = 0):
    import transformers
    torch.manual_seed(seed)
    config = transformers.AutoConfig.for_model(**cfg)
    with torch.device(_common.DEV):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    with torch.no_grad():  # logits of a trained model's scale (a default init's barely move with a 1-ulp change)
        model.lm_head.weight.normal_(0, 0.1)
    return model


def diff(cfg: dict, args) -> dict:
    model = build(cfg)
    bf16 = bitmatch.patch(copy.deepcopy(model))          # the control: the same weights, bf16 projections
    model = bitmatch.patch(model, quantization="fp8")
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, cfg["vocab_size"], (int(n),), generator=g).tolist()
               for n in torch.randint(5, args.max_prompt, (args.n_prompts,), generator=g)]
    rows = _common.engine_diff(model, None, prompts, torch.device(_common.DEV), 0.9, args.new_tokens,
                               control=lambda ids, mask: bitmatch.token_logprobs(bf16, ids, mask, temperature=0.9),
                               control_key="control_bf16_trainer_mismatches")
    if not all(r["tokens"] for r in rows):  # nothing compared is no evidence of equality
        raise RuntimeError(f"fp8_model: a diff config compared no tokens: {rows}")
    return {"rows": rows, "tokens": sum(r["tokens"] for r in rows), "mismatches": sum(r["mismatches"] for r in rows),
            "control_bf16_trainer_mismatches": sum(r["control_bf16_trainer_mismatches"] for r in rows)}


def speed(cfg: dict, args) -> dict:
    """Median decode step ms at each batch size, the bf16 engine then the FP8 engine on one model."""
    model = bitmatch.patch(build(cfg))
    out = {}
    for mode in ("bf16", "fp8"):
        cfg_mode = {"quantization": "fp8"} if mode == "fp8" else {}
        eng = bitmatch.Engine(model, max_num_seqs=max(args.batches), kv_cache_bytes=8 << 30,
                              max_num_batched_tokens=max(args.batches) * args.prompt_len, **cfg_mode)
        for B in args.batches:
            g = torch.Generator().manual_seed(B)
            prompts = [torch.randint(0, cfg["vocab_size"], (args.prompt_len,), generator=g).tolist() for _ in range(B)]
            sp = bitmatch.SamplingParams(temperature=1.0, max_tokens=args.new_tokens, ignore_eos=True)
            _common.engine_run(eng, prompts[:2], lambda i: sp)  # warm-up
            wall, steps, _ = _common.engine_run(eng, prompts, lambda i: sp)
            out.setdefault(mode, {})[B] = {"decode_step_ms": _common.decode_ms(steps, args.new_tokens), "wall_s": wall}
            print(mode, B, out[mode][B], flush=True)
        eng.close()
        _common.empty_cache()
    out["fp8_speedup"] = {B: out["bf16"][B]["decode_step_ms"] / out["fp8"][B]["decode_step_ms"]
                          for B in args.batches if out["fp8"][B]["decode_step_ms"]}
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--sections", default="diff,speed")
    ap.add_argument("--batches", default="64,256")
    ap.add_argument("--families", default="qwen3,qwen3_moe")
    ap.add_argument("--n-prompts", type=int, default=40)
    ap.add_argument("--max-prompt", type=int, default=300)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=128)
    args = ap.parse_args()
    args.batches = [int(b) for b in args.batches.split(",")]
    smoke = _common.DEV != "cuda"
    if smoke:  # the script's logic on CPU, tiny
        args.n_prompts, args.max_prompt, args.new_tokens, args.batches, args.prompt_len = 4, 24, 3, [2], 8
    os.makedirs(args.out, exist_ok=True)
    rec = _common.Recorder(os.path.join(args.out, "fp8_model.json"), args)
    t0 = time.perf_counter()
    for fam in args.families.split(",") if "diff" in args.sections else ():
        cfg = {"qwen3": SMALL, "qwen3_moe": SMALL_MOE}[fam]
        if smoke:  # the same family, tiny
            cfg = {**cfg, **{k: SMOKE[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers",
                                                  "num_attention_heads", "num_key_value_heads", "head_dim",
                                                  "vocab_size")}, **({"moe_intermediate_size": 128,
                                                                      "num_experts": 8} if fam != "qwen3" else {})}
        try:
            rec.put(f"diff/{fam}", diff(cfg, args))
        except Exception:
            rec.err(f"diff/{fam}")
    if "speed" in args.sections:
        try:
            rec.put("speed/qwen3_8b" if not smoke else "speed/smoke", speed(SMOKE if smoke else QWEN3_8B, args))
        except Exception:
            rec.err("speed")
    rec.put("wall_s", time.perf_counter() - t0)
    print("wrote", os.path.join(args.out, "fp8_model.json"))


if __name__ == "__main__":
    main()
