#!/usr/bin/env bash
# The GPU measurements still open, in stages that each fit one device call (10 minutes) on an H200, writing
# their logs and JSON under $OUT. Run it on the device machine after the three bundle installs of
# ../shared/gpu/README.md (a, b, c: one call each, each with its bundle in `carry`), with GPU_SITE naming the
# folder those installs filled (the recipe's site folder; each install leaves a .bundle-<name> marker there):
#
#   GPU_SITE=<site folder> bash scripts/gpu-measure.sh STAGE
#
#   moe          tests/gpu/test_gpu.py -k moe (packed == per-document must route every token-layer the same),
#                moe_batch_invariance.py --model (must find no differing row), bench_moe.py LoRA rows on the
#                RL batch (it also times the experts alone)                                          ~6 min
#   moe-vocab    bench_moe.py with the real 248,320 vocab (MOE_VOCABS=65536 for the 3x goal's), ours and the
#                built-in                                                                            ~2 min
#   moe-kernels  bench_moe.py, RL batch: ours with the Triton / the eager top-k combine              ~3 min
#   conv         tests/gpu/test_gpu.py -k "conv or elementwise", bench_conv.py (tile configurations)    ~3 min
#   host         host_overhead.py: host time per elementwise call, eager / compiled / Triton        ~1 min
#   dense-0p8b   bench_train_step.py, Qwen3.5-0.8B, uniform batch (host-bound), ours with fused and
#                eager elementwise chains, and the built-in                                          ~4 min
#   dense-1p4b   bench_train_step.py, hybrid 1.4B, both batches, ours and the built-in               ~3 min
#   dense-4b     bench_train_step.py, Qwen3.5-4B, both batches                                       ~2 min
#   dense-9b     bench_train_step.py, Qwen3.5-9B (first 16 layers), both batches                     ~2 min
#   trace-0p8b   trace_train_step.py, Qwen3.5-0.8B, uniform batch (host-bound: where the host goes)  ~1 min
#   trace-1p4b   trace_train_step.py, hybrid 1.4B, RL batch (kernel-bound: where the kernels go)     ~3 min
#   gpu-tests-1  tests/gpu/test_gpu.py, its first part: the GDN kernels (FLA, FlashQLA, masks with holes)
#   gpu-tests-2  its second part: attention (varlen, long documents), the Triton chains and gated norm, recompute,
#                host syncs
#   gpu-tests-3  the rest (-k "not <part 1> and not <part 2>": conv, chunked loss, MoE, expert LoRA). On a fresh
#                H100 the first twelve tests took over 9 minutes (Triton autotuning and TileLang compiles), so the
#                file runs as three stages (gpu-suite runs them with the rest of tests/gpu, at once)
#   gpu-suite    every file of tests/gpu at once, one process each (test_gpu.py as its three parts), then the
#                real-shapes file alone: the whole GPU suite in one call on a fresh machine, its compiles overlapping
#                (on a fresh H100: 7.6 min, the context-parallel file the longest)
#   real-shapes  tests/gpu/test_gpu_real_shapes.py (Qwen3.5-4B and the 35B-A3B layer shapes, bitwise), then
#                tests/gpu/test_gpu_projection.py (the row-invariant product over row counts)          ~5 min
#   full-depth   full_depth_exactness.py: the whole 35B-A3B, ours and the built-in                   ~2 min
#   any-batch-35b  full_depth_exactness.py --random-batches: the whole 35B-A3B, 5 random long-tail batches, then 3
#                with PEFT LoRA (GDN, attention, experts) under bf16 autocast (TRL's bf16=True: the adapters'
#                in-place sum), from one seed (SEED, default the clock; printed)                      ~6 min
#   any-batch-4b   the same for Qwen3.5-4B (all 32 layers)                                              ~3 min
#   invariance-cost  bench_moe.py (4 layers, vocab 65,536) and bench_train_step.py (hybrid 1.4B), RL batch: ours
#                with the row-invariant products and with plain GEMMs, side by side in one process each   ~3 min
#   moe-locate   moe_batch_invariance.py --shapes 35b-a3b, block and model level (+ short documents) ~3 min
#   expert-lora  tests/gpu/test_gpu.py -k expert_lora (low-rank expert LoRA against PEFT in bf16), then
#                bench_moe.py's LoRA rows with the low-rank products and with PEFT's path            ~6 min
#   workload-35b-ours     bench_workload.py, the whole Qwen3.5-35B-A3B with LoRA, ours: the RL batch (expert
#                LoRA as low-rank products / PEFT's path, LoRA without experts), one document of 32k
#                (profiled) / 128k / 64k tokens, then the RL batch without checkpointing (out of memory last)
#                                                                                                    ~8 min
#   workload-35b-builtin  the same model, the built-in: 32k, the RL batch without and with expert LoRA ~4 min
#   workload-4b-ours      bench_workload.py, Qwen3.5-4B full fine-tune, ours: one document of 32k
#                (profiled) / 128k / 256k tokens                                                     ~7 min
#   workload-4b-builtin   the same, the built-in: 32k / 128k                                          ~3 min
#   context-parallel  tests/gpu/test_gpu_context_parallel.py (2 processes on the GPU, 35B-A3B layer shapes: the
#                sharded row against the unsharded one, fp32 and bf16)                               ~5 min
#   long-attention  tests/gpu/test_gpu.py -k long_documents (long documents alone through SDPA: packed == per-document,
#                against the varlen kernel, attention timed both ways), then workload-4b-ours's 32k and 128k rows
#                with long_document_attention=sdpa (profiled at 32k)                                 ~5 min
#   trace-35b-rl  bench_workload.py, the whole Qwen3.5-35B-A3B with LoRA (low-rank expert products), ours, issue 46's
#                two RL rows (bf16 adapters; PEFT's default adapters under autocast), each profiled (kernel classes,
#                the top kernels split by the host operators that launched them, idle gaps, forward / backward
#                split; an H100 at aad2973, bundle b installed in the same call: 2.9 min to the second row's profile)
#   offload-4b   bench_workload.py, Qwen3.5-4B full fine-tune, ours, under TRL's activation offloading: 128k
#                (and under save_on_cpu), 32k, 256k tokens                                            ~6 min
#   adapters-35b  bench_workload.py, the whole Qwen3.5-35B-A3B with LoRA, ours, RL batch: adapters in bf16
#                (profiled), fp32 adapters under autocast, each with the in-place adapter sum and with PEFT's own
#                LoRA forward                                                                         ~5 min
#   long-doc-35b  bench_workload.py, the whole Qwen3.5-35B-A3B with LoRA, ours, one 131,072-token document under
#                TRL's activation offloading and its bf16=True (autocast, PEFT's default adapters): as is, with the MoE
#                blocks in checkpointed chunks of 16,384 tokens (moe_token_chunk), then also the GDN delta rule in
#                pieces of 16,384 (gdn_token_chunk); the last two with what is live at the memory peak (or the
#                out-of-memory failure) by allocating line                                           ~7 min
#   layer-pieces-tests  tests/gpu/test_gpu_real_shapes.py -k "continued_attention or layer_pieces or autograd_contexts"
#                (a cut document's attention kernel against whole-document attention; layer_token_chunk=1024 against
#                whole layers at the 35B-A3B layer shapes; what the GPU kernels' autograd contexts hold outside their
#                saved tensors; on an H100 the first two: 3 min with the first autotuning, 1.6 min after the GRPO stage)
#   layer-pieces-35b  bench_workload.py, the whole Qwen3.5-35B-A3B with LoRA, ours, every decoder layer in checkpointed
#                pieces of 16,384 tokens (layer_token_chunk): a 32,768-token document first (a cut document's kernels
#                autotune at its size, not beside the long document's step), then the 131,072-token document under
#                TRL's activation offloading with PEFT's default adapters under autocast (what is live at its memory
#                peak) and with bf16 adapters. On an H100 at tree 6530e41 the same rows in pieces of 8,192 fit (76.31 /
#                72.94 GiB); the two documents' rows with the memory step took 9 min there. In pieces of 16,384 the
#                document ran out of memory at trees e3e9e64, db36c73 and 16e7596, before f8add2d stopped every
#                layer's expert-row map from living until the backward ended: not run since
#   recheck-35b  bench_workload.py, the whole 35B-A3B with LoRA, ours: the RL rows that earlier ran with adapters
#                injected again and not adopted (fixed in 1d896b8), smallest expected peak first (a row out of memory
#                leaves the later ones not run): bf16 adapters with the MoE in chunks, PEFT's default adapters under
#                autocast (profiled), then checkpoint_granularity mlp / mixer with each adapter kind      ~6 min
#   recompute-offload-35b  bench_workload.py, the whole 35B-A3B with LoRA, ours, the RL batch: selective recompute
#                (checkpoint_granularity mixer / mlp) under TRL's activation offloading, with each adapter kind (without
#                it they ran out of memory on an H100), then what is live when the mixer row without it fails
#                (RECOMPUTE_ROWS=ROW,.. runs other rows: they must include the --memory-at-peak row) ~6 min
#   goals-35b    bench_workload.py, the whole Qwen3.5-35B-A3B with LoRA, ours: the RL batch with bf16 adapters and
#                PEFT's default fp32 adapters under autocast (TRL's bf16=True), the latter also under TRL's
#                activation offloading and with the MoE blocks in chunks (what fit it on an 80 GB card), the
#                131,072-token document (offloading, MoE in chunks, GDN in pieces) with each adapter kind, then the RL
#                rows with checkpoint_granularity mlp / mixer (what the backward reruns of each checkpointed layer: its
#                MLP / MoE block, its mixer): every goal row of issue 46 in one process, which pays the model's build
#                and first autotuning once; what is live at the memory peak (or the failure) of the default
#                adapters' RL row and document row (an H100, without the offloading and MoE-chunk rows, and then
#                long-doc-35b: 4.5 min)                                                              ~8 min
#   goals-35b-adamw  the same model and batch, each step ending with AdamW's step (its state in the peak, as in a
#                trainer): bf16 adapters, LoRA without experts, PEFT's default adapters under autocast (an H200;
#                the no-experts row alone, with bundle b's install, took 2.5 min on a fresh H100)
#   generate     bench_generate.py --profile: generate() ours (dynamic cache, and static cache with its decode steps
#                replayed as CUDA graphs) and the built-in, batch 16, prompts of 512 tokens, 64 new tokens, greedy,
#                and where a decode step goes: Qwen3.5-4B (first 8 layers), then the whole 35B-A3B (first call and
#                warm; without the profiles and the static rows it took 2.5 min)                    ~6 min
#   generate-4b-sweep  bench_generate.py, Qwen3.5-4B (first 8 layers), ours (dynamic and static cache) and the
#                built-in, batch 1 / 16 / 64, prompts of 512 tokens, 256 new tokens, greedy and sampled (an H100:
#                ours' rows took 1.9 min; the built-in's not reached)                               ~8 min
#   generate-0p8b-sweep  the same for the whole Qwen3.5-0.8B (not run yet)                          ~8 min
#   generate-4096  the same three, batch 16, prompts of 4,096 tokens, 256 new tokens, greedy: Qwen3.5-4B (first 8
#                layers) and the whole 0.8B                                                         ~3 min
#   generate-35b-sweep  ours (static cache) and the built-in on the whole 35B-A3B, batch 1 / 16 / 64, prompts of 512,
#                256 new tokens, greedy (ours' dynamic cache at batch 16: the generate stage; an H100: 6.4 min)  ~7 min
#   generate-tests  tests/gpu/test_gpu_generate.py: the static cache's CUDA-graph steps against its eager steps
#                (bitwise) and one full forward, generate() with both; 4B (8 layers), 35B-A3B shapes (4 layers);
#                test_gpu_vl.py -k static_cache (generate with an image)                               ~2 min
#   grpo-step    bench_grpo_step.py: one GRPO step without vLLM (generation, scoring, training), ours (the static
#                cache, PackedGRPOTrainer's default on CUDA), LoRA, 8 prompts x 8 completions of 256 tokens after 512:
#                Qwen3.5-4B. `grpo-step-builtin`: the built-in through TRL's GRPOTrainer; `grpo-step-dynamic`: ours with
#                the dynamic cache. One implementation per stage: on a fresh H100 ours dynamic took 4.7 min (3.4 of
#                them its first step's compiles), ours static 0.6 min after it, and the built-in was still compiling
#                its first step 4 min later
#   grpo-step-35b, grpo-step-35b-builtin  the same for the whole 35B-A3B, each step's completions trained in 4
#                micro-batches (an H200: on an H100 ours ran out of memory even at 2 x 8 in one forward: weights, fp32
#                adapters, their gradients and AdamW's state alone are 78.6 GiB, counted by lora_memory_budget.py)
#   grpo-step-35b-bf16-adapters  ours on the whole 35B-A3B with bf16 adapters (71.6 GiB before activations: what an
#                80 GB card might hold), each step's completions generated in 4 rounds of two prompts' 16 and trained in 8
#                micro-batches, one warm-up step and one timed. On an H100 (tree 6530e41), generated at once and trained
#                in 4 micro-batches, the first step ran whole and the second step's generation ran out of memory: AdamW's
#                state beside the weights left too little for 64 completions' cache and prefill
#   grpo-step-35b-builtin-bf16-adapters  the built-in through TRL's GRPOTrainer, the same adapters, rounds and
#                micro-batches (an H100 at 108beee: the warm-up step's 419 s ended, the 575 s limit cut the timed step;
#                the file is rewritten after each step, so a cut run keeps the steps that ended)
#   grpo-step-35b-builtin-bf16-adapters-warm-caches  the same with --warmup 0, in the call right after it on the same
#                machine: one step, its process's first, on the compiled kernels the run before left (H100: 308 s)
#   grpo-step-35b-offload  ours on the whole 35B-A3B with PEFT's default adapters, each training step in TRL's
#                activation offloading (PackedGRPOTrainer(activation_offloading=True); not run yet)
#   changing-lengths  bench_changing_lengths.py: a new packed length every round (8 documents of 200-3,000 tokens),
#                the stall it costs over the same row again, ours and the built-in: Qwen3.5-4B (8 layers), the
#                35B-A3B layer shapes (4 layers)                                                     ~5 min
#   holes        tests/gpu/test_gpu.py -k holes (masks with holes through the GPU kernels against the PyTorch path,
#                fp32 and bf16)                                                                     ~2 min
#
# Bundle c (transformers 5.24, causal_conv1d) is needed only where the built-in runs; the workload-*-ours stages run
# without it, on the machine's transformers. Exit 3: the machine went cold and lost the bundles; install them again. The stage times are those measured in
# earlier runs of the same scripts; the 10-minute limit cuts a stage that runs over, and what it wrote under
# $OUT still comes back. The commit the tree was sent at is not knowable there (`git rev-parse HEAD` answers the
# session's first commit): record it on the sending side.
set -uo pipefail
stage=${1:?usage: scripts/gpu-measure.sh STAGE (see the header)}
: "${OUT:?OUT must name the folder whose files come back}"
: "${GPU_SITE:?GPU_SITE must name the folder the bundle installs filled}"
case "$stage" in
  workload-*-ours | long-attention | context-parallel | trace-35b-rl | offload-4b | adapters-35b | long-doc-35b \
    | goals-35b | goals-35b-adamw | recheck-35b | recompute-offload-35b | layer-pieces-35b | layer-pieces-tests \
    | holes | real-shapes | any-batch-* | invariance-cost | generate-tests) needed="a b" ;;
  *) needed="a b c" ;;
esac
for bundle in $needed; do test -e "$GPU_SITE/.bundle-$bundle" || exit 3; done
# Triton's compiled kernels beside the bundles: kept while the machine stays warm, reused by the next stage.
export PYTHONPATH="$GPU_SITE:$PWD" TRITON_CACHE_DIR="$GPU_SITE/.triton-cache" PYTHONUNBUFFERED=1
failed=0
# tests/gpu/test_gpu.py in three parts (the third: everything the first two leave)
gpu_tests_part1="fla_packed or flash_qla or holes"
gpu_tests_part2="varlen or long_documents or elementwise or gated_norm or recompute or host_syncs"
gpu_tests_part3="not ($gpu_tests_part1) and not ($gpu_tests_part2)"
# step NAME CMD...: CMD's output to $OUT/NAME.log; a failing step is reported (and returns its status) and the stage
# goes on.
step() {
  local name=$1
  shift
  "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "$name: exit $rc"
  tail -n 3 "$OUT/$name.log"
  [ $rc -eq 0 ] || failed=1
  return $rc
}

case "$stage" in
  moe)
    step gpu-tests-moe env QWEN35_GPU_RESULTS="$OUT/gpu-tests-moe.json" \
      python3 -m pytest -q -p no:cacheprovider tests/gpu/test_gpu.py -k moe
    step moe-locate python3 benchmarks/moe_batch_invariance.py --model --out "$OUT/moe-locate.json"
    step moe-lora python3 benchmarks/bench_moe.py --vocabs 65536 --batches rl_longtail_x16 \
      --runs builtin_lora,ours_lora --out "$OUT/moe-lora.json"
    ;;
  context-parallel)
    step context-parallel env QWEN35_GPU_RESULTS="$OUT/gpu-context-parallel.json" \
      python3 -m pytest -q -p no:cacheprovider tests/gpu/test_gpu_context_parallel.py
    ;;
  moe-vocab)
    step moe-vocab python3 benchmarks/bench_moe.py --vocabs "${MOE_VOCABS:-248320}" --runs builtin_correct_packed,ours_packed \
      --skip-lora --skip-experts --out "$OUT/moe-vocab.json"
    ;;
  moe-kernels)
    step moe-kernels python3 benchmarks/bench_moe.py --vocabs 65536 --batches rl_longtail_x16 \
      --runs ours_packed,ours_packed_eager_combine --skip-lora \
      --out "$OUT/moe-kernels.json"
    ;;
  conv)
    step gpu-tests-conv env QWEN35_GPU_RESULTS="$OUT/gpu-tests-conv.json" \
      python3 -m pytest -q -p no:cacheprovider tests/gpu/test_gpu.py -k "conv or elementwise"
    step conv python3 benchmarks/bench_conv.py --out "$OUT/conv.json" --best "$OUT/conv-best.json"
    ;;
  host)
    step host-overhead python3 benchmarks/host_overhead.py --device cuda --out "$OUT/host-overhead.json"
    ;;
  dense-0p8b)
    step dense-0p8b python3 benchmarks/bench_train_step.py --models qwen35_0p8b --batches uniform_128_2048_x8 \
      --runs ours_packed,ours_packed_eager_elementwise,builtin_correct_packed --out "$OUT/dense-0p8b.json"
    ;;
  dense-1p4b)
    step dense-1p4b python3 benchmarks/bench_train_step.py --models hybrid_1p4b \
      --runs ours_packed,builtin_correct_packed --out "$OUT/dense-1p4b.json"
    ;;
  dense-4b | dense-9b)
    models=$([ "$stage" = dense-4b ] && echo qwen35_4b || echo qwen35_9b:16)
    step "$stage" python3 benchmarks/bench_train_step.py --models "$models" \
      --runs ours_packed,builtin_correct_packed --out "$OUT/$stage.json"
    ;;
  trace-0p8b | trace-1p4b)
    target=$([ "$stage" = trace-0p8b ] && echo "qwen35_0p8b uniform_128_2048_x8" || echo "hybrid_1p4b rl_longtail_x16")
    read -r model batch <<< "$target"
    step "$stage" python3 benchmarks/trace_train_step.py --model "$model" --batch "$batch" --out "$OUT/$stage.json"
    ;;
  real-shapes)
    step real-shapes env QWEN35_GPU_RESULTS="$OUT/real-shapes.json" \
      python3 -m pytest -q -p no:cacheprovider tests/gpu/test_gpu_real_shapes.py
    step projection-row-counts env QWEN35_GPU_RESULTS="$OUT/projection-row-counts.json" \
      python3 -m pytest -q -p no:cacheprovider tests/gpu/test_gpu_projection.py
    ;;
  full-depth)
    step full-depth python3 benchmarks/full_depth_exactness.py --out "$OUT/full-depth.json"
    ;;
  any-batch-35b | any-batch-4b)
    model=${stage#any-batch-}
    [ "$model" = 35b ] && model=35b_a3b
    seed=${SEED:-$(($(date +%s%N) % 1000000))}
    echo "any-batch seed $seed"
    step "$stage-base" python3 benchmarks/full_depth_exactness.py --model "$model" --random-batches 5 --seed "$seed" \
      --out "$OUT/any-batch-$model-base.json"
    step "$stage-lora" python3 benchmarks/full_depth_exactness.py --model "$model" --random-batches 3 --lora --autocast \
      --seed "$((seed + 100))" --out "$OUT/any-batch-$model-lora.json"
    ;;
  invariance-cost)
    step moe-invariance-cost python3 benchmarks/bench_moe.py --vocabs 65536 --batches rl_longtail_x16 \
      --runs ours_packed,ours_packed_plain_gemms --reps 10 --skip-lora --skip-experts --out "$OUT/moe-invariance-cost.json"
    step dense-invariance-cost python3 benchmarks/bench_train_step.py --models hybrid_1p4b --batches rl_longtail_x16 \
      --runs ours_packed,ours_packed_plain_gemms --out "$OUT/dense-invariance-cost.json"
    ;;
  moe-locate)
    step moe-locate-block python3 benchmarks/moe_batch_invariance.py --shapes 35b-a3b --out "$OUT/moe-locate-block.json"
    step moe-locate-model python3 benchmarks/moe_batch_invariance.py --shapes 35b-a3b --model --extra-docs 1,7,64 \
      --out "$OUT/moe-locate-model.json"
    ;;
  expert-lora)
    step gpu-tests-expert-lora env QWEN35_GPU_RESULTS="$OUT/gpu-tests-expert-lora.json" \
      python3 -m pytest -q -p no:cacheprovider tests/gpu/test_gpu.py -k expert_lora
    step moe-expert-lora python3 benchmarks/bench_moe.py --vocabs 65536 \
      --batches rl_longtail_x16 --runs builtin_lora,ours_lora_low_rank,ours_lora_peft_fold --skip-experts \
      --out "$OUT/moe-expert-lora.json"
    ;;
  workload-35b-ours)
    step workload-35b-ours python3 benchmarks/bench_workload.py --model qwen35_35b_a3b --impl ours \
      --rows rl:lora_low_rank,rl:lora_peft_fold,doc_32768:lora_low_rank,doc_131072:lora_low_rank,doc_65536:lora_low_rank,rl:lora_no_experts,rl:lora_low_rank_no_ckpt \
      --profile doc_32768:lora_low_rank --out "$OUT/workload-35b-ours.json"
    ;;
  workload-35b-builtin)
    step workload-35b-builtin python3 benchmarks/bench_workload.py --model qwen35_35b_a3b --impl builtin \
      --rows doc_32768:lora,rl:lora_no_experts,rl:lora --out "$OUT/workload-35b-builtin.json"
    ;;
  workload-4b-ours)
    step workload-4b-ours python3 benchmarks/bench_workload.py --model qwen35_4b --impl ours \
      --rows doc_32768:full,doc_131072:full,doc_262144:full --profile doc_32768:full --out "$OUT/workload-4b-ours.json"
    ;;
  workload-4b-builtin)
    step workload-4b-builtin python3 benchmarks/bench_workload.py --model qwen35_4b --impl builtin \
      --rows doc_32768:full,doc_131072:full --profile doc_32768:full --out "$OUT/workload-4b-builtin.json"
    ;;
  long-attention)
    step gpu-tests-long-attention env QWEN35_GPU_RESULTS="$OUT/gpu-tests-long-attention.json" \
      python3 -m pytest -q -p no:cacheprovider tests/gpu/test_gpu.py -k long_documents
    step workload-4b-ours-long-attention python3 benchmarks/bench_workload.py --model qwen35_4b --impl ours \
      --rows doc_32768:full,doc_131072:full --profile doc_32768:full --config long_document_attention=sdpa \
      --out "$OUT/workload-4b-ours-long-attention.json"
    ;;
  trace-35b-rl)
    rows=rl:lora_low_rank_bf16_adapters,rl:lora_low_rank_autocast
    step trace-35b-rl python3 benchmarks/bench_workload.py --model qwen35_35b_a3b --impl ours \
      --rows "$rows" --profile "$rows" --out "$OUT/trace-35b-rl.json"
    ;;
  generate)
    step generate-4b python3 benchmarks/bench_generate.py --models qwen35_4b:8 --impls ours,ours:static,builtin \
      --batches 16 --prompts 512 --new-tokens 64 --modes greedy --reps 1 --profile --out "$OUT/generate-4b.json"
    step generate-35b python3 benchmarks/bench_generate.py --models qwen35_35b_a3b --impls ours,ours:static,builtin \
      --batches 16 --prompts 512 --new-tokens 64 --modes greedy --reps 1 --profile --out "$OUT/generate-35b.json"
    ;;
  generate-4b-sweep | generate-0p8b-sweep)
    model=$([ "$stage" = generate-4b-sweep ] && echo qwen35_4b:8 || echo qwen35_0p8b)
    step "$stage" python3 benchmarks/bench_generate.py --models "$model" --impls ours,ours:static,builtin \
      --batches 1,16,64 --prompts 512 --new-tokens 256 --modes greedy,sampled --reps 1 --out "$OUT/$stage.json"
    ;;
  generate-4096)
    step generate-4096 python3 benchmarks/bench_generate.py --models qwen35_4b:8,qwen35_0p8b \
      --impls ours,ours:static,builtin --batches 16 --prompts 4096 --new-tokens 256 --modes greedy --reps 1 \
      --out "$OUT/generate-4096.json"
    ;;
  generate-35b-sweep)
    step generate-35b-sweep python3 benchmarks/bench_generate.py --models qwen35_35b_a3b \
      --impls ours:static,builtin --batches 1,16,64 --prompts 512 --new-tokens 256 --modes greedy --reps 1 \
      --out "$OUT/generate-35b-sweep.json"
    ;;
  generate-tests)
    step gpu-tests-generate env QWEN35_GPU_RESULTS="$OUT/gpu-tests-generate.json" \
      python3 -m pytest -q -p no:cacheprovider tests/gpu/test_gpu_generate.py
    step gpu-tests-generate-vl env QWEN35_GPU_VL_RESULTS="$OUT/gpu-tests-generate-vl.json" \
      python3 -m pytest -q -p no:cacheprovider tests/gpu/test_gpu_vl.py -k static_cache
    ;;
  grpo-step | grpo-step-builtin | grpo-step-dynamic | grpo-step-35b | grpo-step-35b-builtin | grpo-step-35b-bf16-adapters \
    | grpo-step-35b-builtin-bf16-adapters | grpo-step-35b-builtin-bf16-adapters-warm-caches | grpo-step-35b-offload)
    model=qwen35_4b impl=ours:static adapters=()
    # the whole 35B-A3B trains each step's 64 completions in 4 forwards (gradient accumulation), as on a card it fills
    case $stage in *35b*) model=qwen35_35b_a3b adapters=(--micro-batches 4) ;; esac
    case $stage in *-builtin*) impl=builtin ;; *-dynamic) impl=ours:dynamic ;; esac
    case $stage in
      *-bf16-adapters) adapters=(--bf16-adapters --micro-batches 8 --generation-rounds 4 --steps 1) ;;
      *-bf16-adapters-warm-caches) adapters=(--bf16-adapters --micro-batches 8 --generation-rounds 4 --steps 1 --warmup 0) ;;
      *-offload) adapters+=(--activation-offloading) ;;
    esac
    step "$stage" python3 benchmarks/bench_grpo_step.py --models "$model" --impls "$impl" "${adapters[@]}" \
      --out "$OUT/$stage.json"
    ;;
  changing-lengths)
    step changing-lengths python3 benchmarks/bench_changing_lengths.py --out "$OUT/changing-lengths.json"
    ;;
  holes)
    step gpu-tests-holes env QWEN35_GPU_RESULTS="$OUT/gpu-tests-holes.json" \
      python3 -m pytest -q -p no:cacheprovider tests/gpu/test_gpu.py -k holes
    ;;
  adapters-35b)
    step adapters-35b python3 benchmarks/bench_workload.py --model qwen35_35b_a3b --impl ours \
      --rows rl:lora_low_rank_bf16_adapters,rl:lora_low_rank_bf16_adapters_peft_sums,rl:lora_low_rank_autocast,rl:lora_low_rank_autocast_peft_sums \
      --profile rl:lora_low_rank_bf16_adapters --out "$OUT/adapters-35b.json"
    ;;
  layer-pieces-tests)
    step layer-pieces-tests env QWEN35_GPU_RESULTS="$OUT/layer-pieces-tests.json" \
      python3 -m pytest -q -s -p no:cacheprovider tests/gpu/test_gpu_real_shapes.py \
      -k "continued_attention or layer_pieces or autograd_contexts"
    ;;
  layer-pieces-35b)
    step layer-pieces-35b python3 benchmarks/bench_workload.py --model qwen35_35b_a3b --impl ours \
      --rows doc_32768:lora_low_rank_offload_autocast_layer_chunk,doc_131072:lora_low_rank_offload_autocast_layer_chunk,doc_131072:lora_low_rank_offload_bf16_adapters_layer_chunk \
      --memory-at-peak doc_131072:lora_low_rank_offload_autocast_layer_chunk \
      --out "$OUT/layer-pieces-35b.json"
    ;;
  long-doc-35b)
    step long-doc-35b python3 benchmarks/bench_workload.py --model qwen35_35b_a3b --impl ours \
      --rows doc_131072:lora_low_rank_offload_autocast,doc_131072:lora_low_rank_offload_autocast_moe_chunk,doc_131072:lora_low_rank_offload_autocast_moe_chunk_gdn_chunk \
      --memory-at-peak doc_131072:lora_low_rank_offload_autocast_moe_chunk,doc_131072:lora_low_rank_offload_autocast_moe_chunk_gdn_chunk \
      --out "$OUT/long-doc-35b.json"
    ;;
  goals-35b-adamw)
    step goals-35b-adamw python3 benchmarks/bench_workload.py --model qwen35_35b_a3b --impl ours \
      --rows rl:lora_low_rank_bf16_adapters_adamw,rl:lora_no_experts_adamw,rl:lora_low_rank_autocast_adamw \
      --out "$OUT/goals-35b-adamw.json"
    ;;
  recheck-35b)
    step recheck-35b python3 benchmarks/bench_workload.py --model qwen35_35b_a3b --impl ours \
      --rows rl:lora_low_rank_bf16_adapters_moe_chunk,rl:lora_low_rank_autocast,rl:lora_low_rank_bf16_adapters_ckpt_mlp,rl:lora_low_rank_bf16_adapters_ckpt_mixer,rl:lora_low_rank_autocast_ckpt_mlp,rl:lora_low_rank_autocast_ckpt_mixer \
      --profile rl:lora_low_rank_autocast --out "$OUT/recheck-35b.json"
    ;;
  recompute-offload-35b)
    step recompute-offload-35b python3 benchmarks/bench_workload.py --model qwen35_35b_a3b --impl ours \
      --rows ${RECOMPUTE_ROWS:-rl:lora_low_rank_offload_bf16_adapters_ckpt_mixer,rl:lora_low_rank_offload_autocast_ckpt_mixer,rl:lora_low_rank_offload_bf16_adapters_ckpt_mlp,rl:lora_low_rank_bf16_adapters_ckpt_mixer} \
      --memory-at-peak rl:lora_low_rank_bf16_adapters_ckpt_mixer --out "$OUT/recompute-offload-35b.json"
    ;;
  goals-35b)
    step goals-35b python3 benchmarks/bench_workload.py --model qwen35_35b_a3b --impl ours \
      --rows rl:lora_low_rank_bf16_adapters,rl:lora_low_rank_autocast,rl:lora_low_rank_offload_autocast,rl:lora_low_rank_autocast_moe_chunk,doc_131072:lora_low_rank_offload_autocast_moe_chunk_gdn_chunk,doc_131072:lora_low_rank_offload_bf16_adapters_moe_chunk_gdn_chunk,rl:lora_low_rank_bf16_adapters_ckpt_mlp,rl:lora_low_rank_bf16_adapters_ckpt_mixer,rl:lora_low_rank_autocast_ckpt_mlp,rl:lora_low_rank_autocast_ckpt_mixer \
      --memory-at-peak rl:lora_low_rank_autocast,doc_131072:lora_low_rank_offload_autocast_moe_chunk_gdn_chunk \
      --out "$OUT/goals-35b.json"
    ;;
  offload-4b)
    step offload-4b python3 benchmarks/bench_workload.py --model qwen35_4b --impl ours \
      --rows doc_131072:full_offload,doc_131072:full_save_on_cpu,doc_32768:full_offload,doc_262144:full_offload \
      --out "$OUT/offload-4b.json"
    ;;
  gpu-suite)
    # Nothing in tests/gpu is timed, so every file (test_gpu.py in its three parts) runs in its own process at once:
    # a fresh machine spends most of its time compiling on the CPU, and 16 cores overlap that. The real-shapes file
    # (the 35B-A3B's 248,320-wide logits of ~30k tokens) runs alone afterwards: beside the others it ran out of
    # memory on an H100. Processes sharing a card: expandable segments hold less memory unused.
    pids=()
    suite_test() {  # NAME FILE [pytest -k SELECTION]: one file's tests, in the background
      local name=$1 file=$2
      shift 2
      step "$name" env QWEN35_GPU_RESULTS="$OUT/$name.json" QWEN35_GPU_VL_RESULTS="$OUT/$name.json" \
        PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True python3 -m pytest -q -p no:cacheprovider "$file" "$@" &
      pids+=($!)
    }
    suite_test gpu-tests-1 tests/gpu/test_gpu.py -k "$gpu_tests_part1"
    suite_test gpu-tests-2 tests/gpu/test_gpu.py -k "$gpu_tests_part2"
    suite_test gpu-tests-3 tests/gpu/test_gpu.py -k "$gpu_tests_part3"
    for file in tests/gpu/test_*.py; do
      case $file in tests/gpu/test_gpu.py | tests/gpu/test_gpu_real_shapes.py) ;; *) suite_test "$(basename "$file" .py)" "$file" ;; esac
    done
    for pid in "${pids[@]}"; do wait "$pid" || failed=1; done
    suite_test test_gpu_real_shapes tests/gpu/test_gpu_real_shapes.py
    wait "$!" || failed=1
    ;;
  gpu-tests-[123])
    select="gpu_tests_part${stage#gpu-tests-}"
    step "$stage" env QWEN35_GPU_RESULTS="$OUT/$stage.json" \
      python3 -m pytest -q -p no:cacheprovider tests/gpu/test_gpu.py -k "${!select}"
    ;;
  *)
    echo "unknown stage '$stage' (see the header of $0)" >&2
    exit 2
    ;;
esac
exit $failed
