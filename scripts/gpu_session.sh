#!/usr/bin/env bash
# The GPU rows of the open speed issue (27; 21 and 22 are done), in device-tool calls of < 600 s each.
# Issue 27's rows are in (stage 39 the last); stages left from before: 13, 11, 9, 7, 1, 2. The
# golden bits compare with golden_gpu_h100_compiled.json (the stamp since 1b44447;
# golden_gpu_h200_compiled.json holds the one before; older files ran the interpreter).
# Run from a clean export of HEAD with the wheels beside it (.whl: liger_kernel, trl..., the unpacked
# mamba_ssm sdist; see benchmarks/README or docs/results.md):
#   rm -rf .clean && mkdir .clean && git archive HEAD | tar -x -C .clean
#   run(command="cd .clean && bash scripts/gpu_session.sh 1", carry=[".clean", ".whl"])
# Each benchmark has its own time limit, writes its JSON under $OUT/<name> and its log beside it;
# a benchmark that runs out of time loses only its own rows. Everything comes back as $OUT/stage<N>.tgz.
set -u
STAGE=${1:?usage: gpu_session.sh 1|2|3|4|5|6|7|8|9|10|11|12|13|14|15|16|17|18|19|20|21|22|23|24|25|26|27|28|29|30|31|32|36|37|38|39|nh|nh2|nh3|lora|tp}
R=$(pwd)
W=${WHEELS:-$R/../.whl}
OUT=${OUT:?the device tool sets OUT}
python3 -m pip install -q --no-deps --no-build-isolation --no-index . || exit 1
pip install -q --no-index --no-deps --no-compile --target /tmp/site "$W"/*.whl || exit 1
export PYTHONPATH=/tmp/site
export PYTHONFAULTHANDLER=1  # a benchmark stopped by its time limit (SIGABRT) prints where it was
MAMBA="$W/mamba_ssm-2.3.2.post1"
cd /tmp  # the checkout's folders would shadow the installed package

bench() {  # name seconds script args...
  local name=$1 lim=$2 script=$3
  shift 3
  local t0=$SECONDS
  timeout -s ABRT -k 10 "$lim" python3 "$R/benchmarks/$script" --out "$OUT/$name" "$@" >"$OUT/$name.log" 2>&1
  echo "== $name rc=$? $((SECONDS - t0)) s"
  tail -4 "$OUT/$name.log"
}

case $STAGE in
1)  # training: V4 at flash4 (21) and the MoE layer's backward with the forward's saved
    # pre-activations, its launch variants, the forward's bits with autograd on vs off (22), the MoE
    # training step with its host profile (22), dense 1.7B and 8B vs HF + Liger (22)
    bench v4_train 120 deepseek_v4_layer.py --device cuda --config flash4 --sections train --batch 2 --seq 512 --reps 2 --profile
    bench moe_layer_bwd 100 moe_layer.py --tokens 512 --backward --bwd-variants
    bench moe_train 90 moe_e2e.py --sections train --host-profile --budget-s 70
    bench dense_train 170 gpu_train.py --sections train --models 1.7b,8b --budget-s 150
    ;;
2)  # V4 at the mid config, flash4 rollout and decode (21), the golden bits, the Mamba layer against
    # mamba_ssm (27)
    bench v4_mid 190 deepseek_v4_layer.py --device cuda --config mid --sections train,rollout,decode --batch 2 --seq 512
    bench v4_rollout 90 deepseek_v4_layer.py --device cuda --config flash4 --sections rollout --batch 16 --seq 256 --new 32
    bench golden 50 golden_gpu.py --expect "$R/benchmarks/results/golden_gpu_h200.json"
    bench mamba 110 mamba_layer.py --mamba-src "$MAMBA"
    bench v4_decode 80 deepseek_v4_layer.py --device cuda --config flash4 --sections decode --seq 512 --decode-batch 64
    ;;
nh) # issue 27 on the GPU: the Mamba scan and conv under the engine's schedule vs alone at the e2e
    # model's widths, which Nemotron-H block type's ops differ between engine and trainer, the
    # first differing op, the whole-model diff, training with the vectorized, sync-free Mamba backward
    bench mamba_checks 80 mamba_layer.py --mamba-src "$MAMBA" --shapes nemotron_h_e2e --prefill 2048 --batches 1
    bench nh_locate 290 nemotron_h_e2e.py --mamba-src "$MAMBA" --sections diff_blocks,locate,diff,train --budget-s 240
    ;;
lora) # issue 27's LoRA rows: the LoRA rollout (8B shapes, graphs on) vs the same model merged, with
    # its Diff; TRL's GRPO step with a LoRA config, attach vs stock
    bench lora_rollout 200 gpu_e2e.py --sections lora:8b --batches 64 --prompt-len 512 --new-tokens 32
    bench trl_lora 300 trl_step.py --runs stock_lora,attach_lora,attach_lora_copy --steps 5
    ;;
nh3) # issue 27 with the Triton Mamba backward: Nemotron-H training (host profile, gradients vs HF),
    # the whole-model diff with the final capture warm-up, the rollout; the Mamba layer vs mamba_ssm
    # with its forward + backward rows
    bench nh 400 nemotron_h_e2e.py --mamba-src "$MAMBA" --sections train,diff,rollout --batches 32 --host-profile --budget-s 300
    bench mamba 150 mamba_layer.py --mamba-src "$MAMBA" --shapes nemotron_h_8b --batches 1,64
    ;;
6)  # after nh3: V4 mid decode's profile (21), the golden bits, TRL's LoRA step on the colocate share (27)
    bench v4_mid_decode 120 deepseek_v4_layer.py --device cuda --config mid --sections decode --seq 512 --decode-batch 64 --profile
    bench golden 50 golden_gpu.py --expect "$R/benchmarks/results/golden_gpu_h200.json"
    bench trl_lora 240 trl_step.py --runs stock_lora,attach_lora --steps 4
    ;;
7)  # after nh3 and 6: Nemotron-H training with fewer host ops (27), TRL's LoRA step with a profile of a
    # steady step (27), V4 mid decode's profile (21), the Mamba backward's launch knobs at 8B shapes
    # (27), the 8B training step with the TMA rows from time_linear_tma (22)
    bench nh_train 100 nemotron_h_e2e.py --mamba-src "$MAMBA" --sections train --host-profile --budget-s 70
    bench trl_lora 110 trl_step.py --runs stock_lora,attach_lora --steps 3 --profile-step 2
    bench v4_mid_decode 80 deepseek_v4_layer.py --device cuda --config mid --sections decode --seq 512 --decode-batch 64 --profile
    bench mamba_bwd 70 mamba_layer.py --mamba-src "$MAMBA" --shapes nemotron_h_8b --no-checks --batches 64 \
      --bwd-variants '[{"states_BP": 32}, {"states_BP": 16}]'
    bench dense_train_8b 70 gpu_train.py --sections train --models 8b --budget-s 50
    ;;
8)  # stage 7's first rows alone (a short budget): Nemotron-H training, TRL's LoRA step profiled, V4 mid
    # decode's profile
    bench nh_train 80 nemotron_h_e2e.py --mamba-src "$MAMBA" --sections train --host-profile --budget-s 50
    bench trl_lora 80 trl_step.py --runs stock_lora,attach_lora --steps 3 --profile-step 2
    bench v4_mid_decode 75 deepseek_v4_layer.py --device cuda --config mid --sections decode --seq 512 --decode-batch 64 --profile
    ;;
9)  # the two profiles stage 8 ran out of time for on a cold machine
    bench trl_lora 200 trl_step.py --runs stock_lora,attach_lora --steps 3 --profile-step 2
    bench v4_mid_decode 150 deepseek_v4_layer.py --device cuda --config mid --sections decode --seq 512 --decode-batch 64 --profile
    ;;
10) # issue 21 after the launch cuts (one-launch interleaved RoPE, compressor from the stores, MoE
    # layout, range checks): V4 mid decode with its profile; issue 27: TRL's LoRA step with the Diff
    # check on the loss's logprobs vs on an extra forward; the golden bits (the compressor's bits
    # moved: order version 2; expect a stamp change there, and the rest equal)
    bench v4_mid_decode 150 deepseek_v4_layer.py --device cuda --config mid --sections decode --seq 512 --decode-batch 64 --profile
    bench trl_lora 170 trl_step.py --runs stock_lora,attach_lora,attach_lora_gencheck --steps 5 --profile-step 4
    bench golden 50 golden_gpu.py --expect "$R/benchmarks/results/golden_gpu_h200_compiled.json"
    ;;
12) # issue 21 after stage 10's profile: the kept pinned upload buffers (CUDA test), the V4 decode
    # linears' tiles swept at decode M (bits against the table's), the decode step side by side:
    # fresh vs kept pinned uploads, table vs fastest bit-equal tiles
    t0=$SECONDS
    timeout 40 python3 -c "import importlib.util as u; s = u.spec_from_file_location('t', '$R/tests/test_engine_host.py'); m = u.module_from_spec(s); s.loader.exec_module(m); m.test_upload_cpu_is_a_copy(); m.test_upload_cuda_back_to_back_reuse_keeps_every_value(); print('host upload tests passed')" >"$OUT/host_test.log" 2>&1
    echo "== host_test rc=$? $((SECONDS - t0)) s"; tail -2 "$OUT/host_test.log"
    bench v4_tiles 270 deepseek_v4_layer.py --device cuda --config mid --sections tiles --seq 512 --decode-batch 64
    ;;
13) # after 12: the golden bits (the mHC mix kernel now runs 4 K blocks a trip: expect no change;
    # apply_rotary_interleaved's GPU bits are open), V4 mid decode with the decode tiles, profiled
    # (21); TRL's LoRA step, the check on the loss's logprobs beside the extra-forward one (27)
    bench golden 50 golden_gpu.py --expect "$R/benchmarks/results/golden_gpu_h200_compiled.json"
    bench v4_mid_decode 150 deepseek_v4_layer.py --device cuda --config mid --sections decode --seq 512 --decode-batch 64 --profile
    bench trl_lora 260 trl_step.py --runs stock_lora,attach_lora,attach_lora_gencheck --steps 4
    ;;
14) # issue 22's last row (8B training vs HF + Liger, 0.93): the attention backward's tiles at the
    # trainer's shape (4 x 1024) beside cuDNN's (HF's SDPA on Hopper), the TMA linear with its tile
    # and K loops flattened at M = 4096 (bits against the table kernel), the training step before
    # any change; and issue 21's open golden row: apply_rotary_interleaved's GPU bits explained
    bench golden 50 golden_gpu.py --expect "$R/benchmarks/results/golden_gpu_h200_compiled.json" --explain apply_rotary_interleaved
    bench ops_bwd_tma 240 gpu_ops.py --only attention_backward,time_linear_tma --bwd-cases 1024x4,4096x4 --bwd-times 1024x4,4096x4 --tma-ms 4096
    bench dense_train 150 gpu_train.py --sections train --models 1.7b,8b --budget-s 130
    ;;
15) # after 14 (whose backward sweep did not run): the attention backward's tiles at the 8B
    # trainer's shape, then the 8B / 1.7B training step twice each with the default tiles and with
    # the sweep's pick for 4 x 1024, side by side (22); the fp32 -> bf16 probe beside the rotary
    # explanation (21)
    bench golden 50 golden_gpu.py --expect "$R/benchmarks/results/golden_gpu_h200_compiled.json" --explain apply_rotary_interleaved
    bench ops_bwd 200 gpu_ops.py --only attention_backward --bwd-cases 1024x4,4096x4 --bwd-times 1024x4,4096x4
    T=$(python3 -c "import json; c = json.load(open('$OUT/ops_bwd/gpu_ops.json'))['sections']['attention_backward']['chosen_by_case']['S1024_B4']; print(','.join(map(str, c['dq'])) + '/' + ','.join(map(str, c['kv'])))")
    echo "bwd tiles for 4 x 1024: $T"
    bench dense_train 150 gpu_train.py --sections train --models 8b,1.7b --repeat 2
    [ -n "$T" ] && bench dense_train_tiles 150 gpu_train.py --sections train --models 8b,1.7b --repeat 2 --bwd-tiles "$T"
    ;;
16) # after 15: the golden bits on the GPU for real (the earlier files ran the interpreter), the
    # 8B / 1.7B training step at HEAD with the adopted backward tiles (22), V4 mid decode profiled
    # with the decode tiles and the unrolled mHC mix (21), TRL's LoRA step side by side (27)
    bench golden 60 golden_gpu.py
    bench dense_train 120 gpu_train.py --sections train --models 8b,1.7b --repeat 2
    bench v4_mid_decode 150 deepseek_v4_layer.py --device cuda --config mid --sections decode --seq 512 --decode-batch 64 --profile
    bench trl_lora 200 trl_step.py --runs stock_lora,attach_lora --steps 4
    ;;
18) # issue 27's TRL LoRA step (0.54 of stock at stage 16): where a steady attach_lora step spends
    # its host and GPU time now that the Diff check reads the loss's logprobs
    bench trl_lora 200 trl_step.py --runs stock_lora,attach_lora --steps 3 --profile-step 2
    ;;
19) # issue 22's 8B row on the H200 (0.94 of HF + Liger): our backward cuBLAS GEMMs ran 15% slower
    # than stock HF's on the H200 (other kernels for the same products): each product as called and
    # transposed, and the 8B step with HF + Liger's kernels profiled beside ours
    bench dense_train 150 gpu_train.py --sections bwd_gemms,train --models 8b
    ;;
20) # issue 22: the attention (ours 27.6 ms per 8B step, cuDNN 13.5 ms in HF + Liger's, stage 19):
    # the trainer's backward on cuDNN from our forward's output and logsumexp (BWD_BACKEND), its
    # gradients on equal and ragged batches, then the 8B and 1.7B steps on each backend
    bench attn_cudnn 150 gpu_ops.py --only attention_bwd_cudnn
    bench dense_train 300 gpu_train.py --sections train --models 8b --attn-bwd cudnn,triton,cudnn,triton
    bench dense_train_17 120 gpu_train.py --sections train --models 1.7b --attn-bwd triton,auto
    ;;
21) # issue 27's LoRA row with kept casts of the fp32 masters (no LM head re-cast per decode step),
    # then issue 22's 8B / 1.7B steps on the default attention backward ("auto": cuDNN at equal lengths)
    bench trl_lora 260 trl_step.py --runs stock_lora,attach_lora --steps 5
    bench dense_train 160 gpu_train.py --sections train --models 8b,1.7b
    ;;
22) # next: issue 22's 8B row on an H200 with the cuDNN attention backward (the H200 row is still the
    # Triton backward's 0.94; an H100 gives H100 rows)
    bench dense_train 300 gpu_train.py --sections train --models 8b,1.7b --repeat 2
    ;;
23) # issue 22's dense rows with bitmatch and HF + Liger timed in turn (one process, both models
    # held: clock drift falls on both); issue 27's TRL LoRA step, timed, then profiled by phase
    bench dense_train 300 gpu_train.py --sections train --models 8b,1.7b
    bench trl_lora 150 trl_step.py --runs stock_lora,attach_lora --steps 5
    bench trl_lora_prof 120 trl_step.py --runs attach_lora --steps 3 --profile-step 2
    ;;
24) # issue 27's TRL LoRA step with the engine sized to TRL's generation batch (max_num_seqs =
    # per_device_train_batch_size x steps_per_generation, as TRL's colocated vLLM), then profiled
    bench trl_lora 200 trl_step.py --runs stock_lora,attach_lora,attach --steps 6
    bench trl_lora_prof 120 trl_step.py --runs attach_lora --steps 3 --profile-step 2
    ;;
25) # issue 27's Mamba decode with 16-row tiles (the prefill == decode checks on the GPU), beside
    # the former 64-row tile and other decode-only launch variants
    bench mamba_decode 360 mamba_layer.py --mamba-src "$MAMBA" --shapes nemotron_h_8b --prefill 2048,8192 \
      --batches 1,64 --no-backward --decode-variants '[{"BM": 64}, {"BP": 32}, {"num_warps": 2}, {"num_stages": 1}, {"BM": 32}]'
    ;;
26) # issue 27's Mamba prefill of one long sequence with each head's P channels over two programs
    # (the checks on the GPU), beside one program per head (the former config) and a four-way split
    bench mamba_prefill 300 mamba_layer.py --mamba-src "$MAMBA" --shapes nemotron_h_8b --prefill 2048,8192 \
      --batches 1,64 --no-backward --variants '[{"BP": 64}, {"BP": 16}]'
    ;;
27) # issue 27: the whole Nemotron-H model's Diff (engine with graphs vs trainer) and rollout with the
    # decode tiles and the prefill P split
    bench nh 330 nemotron_h_e2e.py --mamba-src "$MAMBA" --sections diff,rollout --batches 32 --budget-s 250
    ;;
28) # issue 27: one-token scan calls with host bounds (no device assert, no stash launch: the scan
    # writes its open rows itself), the layer's checks and decode rows; then the whole model's Diff
    bench mamba_host 150 mamba_layer.py --mamba-src "$MAMBA" --shapes nemotron_h_8b --prefill 8192 --batches 1,64 \
      --no-backward
    bench nh 200 nemotron_h_e2e.py --mamba-src "$MAMBA" --sections diff,rollout --batches 32 --budget-s 150
    ;;
29) # issue 27: more warps for the one-token scan calls (B = 1 is latency-bound), bits checked
    bench mamba_warps 150 mamba_layer.py --mamba-src "$MAMBA" --shapes nemotron_h_8b --prefill 2048 --batches 1,64 \
      --no-backward --no-checks --decode-variants '[{"num_warps": 8}, {"num_warps": 8, "BP": 32}, {"num_stages": 3}]'
    ;;
30) # issue 21: where the V4 mid decode step's kernel time goes (linears by shape), each linear shape
    # cold per tile and K split, the mHC mix per K chunk
    bench v4_ops 540 deepseek_v4_decode_ops.py --config mid --seq 512 --decode-batch 64
    ;;
31) # issue 21 after 30: the routers' fp32 tiles and K split, mHC's 256-wide chunks, the rank-launch
    # expert sort, the one-launch indexer selection: V4 mid's Diff and decode step, then issue 27's
    # decode scan with its C and first K block loaded with the state (PRELOAD) vs after it, the
    # V4 step's kernels, the golden GPU bits (a new stamp)
    bench v4_mid 190 deepseek_v4_layer.py --device cuda --config mid --sections rollout,decode --batch 16 --seq 256 --new 32 --decode-batch 64
    bench mamba_preload 100 mamba_layer.py --mamba-src "$MAMBA" --shapes nemotron_h_8b --prefill 2048 --batches 1,64 \
      --no-backward --no-checks --decode-variants '[{"PRELOAD": false}]'
    bench v4_ops 90 deepseek_v4_decode_ops.py --config mid --seq 512 --decode-batch 64 --sections step
    bench golden 45 golden_gpu.py --expect "$R/benchmarks/results/golden_gpu_h100_compiled.json"
    ;;
32) # issue 21's training rows at the order of 1b44447 (router K splits, mHC chunks of 256; not
    # re-timed when they landed), issue 27's B = 1 decode rows again
    bench v4_mid_train 150 deepseek_v4_layer.py --device cuda --config mid --sections train --batch 2 --seq 512 --reps 2
    bench v4_train 150 deepseek_v4_layer.py --device cuda --config flash4 --sections train --batch 2 --seq 512 --reps 2
    bench mamba_b1 100 mamba_layer.py --mamba-src "$MAMBA" --shapes nemotron_h_8b --prefill 2048 --batches 1,64 \
      --no-backward --no-checks
    ;;
36) # issue 27's B = 1 decode (1.56x with XEARLY, stage 35): a head's P channels over 2 or 4 programs of
    # fewer warps (less serial work per thread, several programs per SM); each timed with its bits
    # checked; the fastest at B = 1, if it beats the default, gets the whole model's Diff with graphs
    bench mamba_bp 150 mamba_layer.py --mamba-src "$MAMBA" --shapes nemotron_h_8b --prefill 2048 --batches 1,64 \
      --no-backward --no-checks --decode-variants \
      '[{"BP": 16, "num_warps": 4}, {"BP": 32, "num_warps": 4}, {"BP": 16, "num_warps": 2}, {"BP": 16, "num_warps": 8}]'
    BEST=$(python3 - "$OUT/mamba_bp/mamba_layer.json" <<'PY'
import json, sys
s = json.load(open(sys.argv[1]))["shapes"]["nemotron_h_8b"]
base = s["decode"][0]["ours_graph_ms"]
ok = [(v["decode"][0]["ours_graph_ms"], v["override"]) for v in s.get("decode_variants", [])
      if v.get("prefill_vs_decode_equal") and v.get("decode") and v["decode"][0].get("ours_graph_ms")]
best = min(ok, key=lambda t: t[0], default=None)
print(json.dumps(best[1]) if best and best[0] < 0.98 * base else "")
PY
)
    echo "fastest B = 1 variant that beats the default: ${BEST:-none}"
    [ -n "$BEST" ] && bench nh_diff 220 nemotron_h_e2e.py --mamba-src "$MAMBA" --sections diff --few-decode-config "$BEST"
    ;;
37) # issue 27's B = 1 decode at a canonical chunk of 64 (the replay half as long) beside 128, with
    # the prefill's cost of it (mamba_ssm's baseline: its rows at chunk 128)
    bench mamba_q64 120 mamba_layer.py --mamba-src "$MAMBA" --shapes nemotron_h_8b,nemotron_h_8b_q64 \
      --prefill 2048 --batches 1,64 --no-backward --no-checks
    ;;
38) # issue 27, first run on branch q64 (Nemotron-H scans in chunks of 64 whatever the checkpoint says, for the
    # decode's replay): the scan's bit checks at chunk 64 (prefill == chunked == decode, packed vs alone,
    # the engine's schedule; the cumsum over 64 positions on the decode's 8 warps vs the prefill's 4),
    # prefill at 2,048 and 8,192 vs mamba_ssm at its 128 (the nemotron_h_8b rows), decode B = 1 / 64;
    # then the whole model (HF at chunk 128, ours at 64): Diff with graphs, rollout, training
    bench mamba_q64 200 mamba_layer.py --mamba-src "$MAMBA" --shapes nemotron_h_8b_q64,nemotron_h_8b \
      --prefill 2048,8192 --batches 1,64 --no-backward
    bench nh_q64 330 nemotron_h_e2e.py --mamba-src "$MAMBA" --sections diff,rollout,train --batches 32 --budget-s 260
    ;;
39) # issue 27 after 38 (the scan at 64 landed): the Mamba layer's forward + backward at 64 beside 128
    # vs mamba_ssm at its 128, prefill and decode again with the checks (a second run of 38's rows)
    bench mamba_q64_bwd 300 mamba_layer.py --mamba-src "$MAMBA" --shapes nemotron_h_8b_q64,nemotron_h_8b \
      --prefill 2048,8192 --batches 1,64
    ;;
11) # after 10: the V4 mid train / rollout / Diff rows and flash4 decode (21), MoE and dense training (22)
    bench v4_decode 90 deepseek_v4_layer.py --device cuda --config flash4 --sections decode --seq 512 --decode-batch 64
    bench v4_mid 200 deepseek_v4_layer.py --device cuda --config mid --sections train,rollout,decode --batch 2 --seq 512
    bench moe_layer_bwd 100 moe_layer.py --tokens 512 --backward --bwd-variants
    bench moe_train 90 moe_e2e.py --sections train --host-profile --budget-s 70
    bench dense_train_8b 120 gpu_train.py --sections train --models 8b --budget-s 100
    ;;
nh2) # issue 27 after the capture fix: the whole-model diff with graphs on, the rollout vs HF with
    # the Mamba kernels; the LoRA rollout with its projections fused
    bench nh_diff 280 nemotron_h_e2e.py --mamba-src "$MAMBA" --sections diff,rollout --batches 32 --budget-s 190
    bench lora_rollout 150 gpu_e2e.py --sections lora:8b --batches 64 --prompt-len 512 --new-tokens 32
    ;;
4)  # next: where Nemotron-H's training step and V4's decode step spend their time (27, 21), the
    # TRL LoRA step with the engine on TRL's colocate memory share (27)
    bench nh_train 200 nemotron_h_e2e.py --mamba-src "$MAMBA" --sections train --host-profile --budget-s 150
    bench v4_mid_decode 120 deepseek_v4_layer.py --device cuda --config mid --sections decode --seq 512 --decode-batch 64 --profile
    bench trl_lora 240 trl_step.py --runs stock_lora,attach_lora --steps 4
    ;;
5)  # the linear's TMA rows for the trainer's unfused 8B shapes (provisional in kernels/triton/linear.py)
    # and the 8B training step vs HF + Liger they are for (22)
    bench linear_tma 150 gpu_ops.py --only time_linear_tma
    bench dense_train_8b 150 gpu_train.py --sections train --models 8b --budget-s 130
    ;;
3)  # what a short session runs after nh and 1: the golden bits, then issue 27's LoRA rows
    bench golden 50 golden_gpu.py --expect "$R/benchmarks/results/golden_gpu_h200.json"
    bench lora_rollout 200 gpu_e2e.py --sections lora:8b --batches 64 --prompt-len 512 --new-tokens 32
    bench trl_lora 240 trl_step.py --runs stock_lora,attach_lora --steps 4
    ;;
tp) # issue 28 on a machine with 2 GPUs (kind nvidia-h200-x2): TP = 2 over NCCL, the gather-only layout's
    # bits and its cost beside the stock all-reduce layout
    bench tp_layout 280 tp_layout.py --world 2
    bench tp_dp_ep 250 tp_layout.py --world 2 --layout dp_ep
    ;;
*)  echo "unknown stage $STAGE (1 to 16, 18 to 20, nh, nh2, nh3, lora or tp)"; exit 2 ;;
esac
# the device tool brings back at most 8 files: one archive of every JSON and log
tar -czf "/tmp/stage$STAGE.tgz" -C "$OUT" . && rm -rf "${OUT:?}"/* && mv "/tmp/stage$STAGE.tgz" "$OUT/"
ls -la "$OUT"
