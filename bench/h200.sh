#!/usr/bin/env bash
# The GPU runs, as steps for one call of the device tool (each step under its own time limit,
# so one failure leaves the others' results). Logs and result files go to $OUT.
#
#   bash bench/h200.sh kernels moe attention invariance     # carry: .whl .cache/autotune
#
# Wheels the GPU image lacks travel in .whl/: bench/gpu-wheels.txt lists them and says how
# to fetch them.
set -u
OUT=${OUT:-/tmp/out}
LOGS=/tmp/h200-logs   # returned as one file, $OUT/logs.tgz: the device tool brings back a
mkdir -p "$LOGS"      # few files only (here: mkdir logs && tar xzf logs.tgz -C logs)
touch /tmp/h200-start   # results newer than this are this call's
# No --xla_gpu_autotune_level=0: without autotuning XLA picked a 10 TFLOP/s GEMM (8192^3).
# XLA_FLAGS passes through from the caller. XLA's autotuning results are kept between calls:
# each step leaves them in $OUT/autotune.tgz; unpack that into .cache here and carry it
# (with .whl) so that the next call's compiles skip the timing runs.
mkdir -p .cache/autotune
export XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_per_fusion_autotune_cache_dir=$(pwd)/.cache/autotune"
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$(pwd)
else
  export PYTHONPATH=$(pwd)
fi
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv \
  > "$LOGS/gpu.txt" 2>&1

step() {   # name, limit in seconds, command...
  local name=$1 limit=$2; shift 2
  local start=$SECONDS
  timeout "$limit" "$@" > "$LOGS/$name.log" 2>&1
  echo "step $name: exit $? in $((SECONDS - start)) s" | tee -a "$LOGS/steps.txt"
  tail -n 3 "$LOGS/$name.log"
  tar czf "$OUT/logs.tgz" -C "$LOGS" .
  find bench/results -name "*gpu*" -newer /tmp/h200-start -exec cp {} "$OUT/" \;  # now, in case
  # a later step outlasts the call
  tar czf "$OUT/autotune.tgz" -C .cache autotune   # one file: the device tool returns a few
  # dozen files at most (here: tar xzf autotune.tgz -C .cache)
}

for name in "$@"; do
  case $name in
    kernels)     step kernels 300 python3 -m pytest -q -p no:cacheprovider tests/kernels ;;
    kernels-new) step kernels-new 300 python3 -m pytest -q -p no:cacheprovider \
                   tests/kernels/test_sinkhorn.py tests/kernels/test_grouped_gemm.py tests/kernels/test_invariant_gemm.py \
                   tests/kernels/test_sink_attention.py tests/engine/test_kernels_in_engine.py \
                   -k "sinkhorn or split or tile_shape or engine" ;;
    sinkhorn)    step sinkhorn 120 python3 -m pytest -q -p no:cacheprovider \
                   tests/kernels/test_sinkhorn.py ;;   # the loop form (VALIDATED_ON_GPU)
    tile-shape)  step tile-shape 90 python3 -m pytest -q -p no:cacheprovider \
                   tests/kernels/test_grouped_gemm.py tests/kernels/test_invariant_gemm.py -k tile_shape ;;
    kernels-defaults) step kernels-defaults 60 python3 -m pytest -q -p no:cacheprovider \
                   tests/kernels -k default_configs ;;
    indexer)     step indexer-tests 120 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_indexer.py
                 step indexer-bench 200 python3 bench/kernels_indexer.py ;;   # kernel vs XLA path, top-k agreement
    attention-tests) step attention-tests 200 python3 -m pytest -q -p no:cacheprovider \
                   tests/kernels/test_sink_attention.py ;;
    engine-kernels) step engine-kernels 200 python3 -m pytest -q -p no:cacheprovider \
                   tests/engine/test_kernels_in_engine.py ;;   # every kernel forced in the engine
    attention-quick) MOSAIC_GPU_DUMP_PTXAS=1 step attention-quick 200 \
                   python3 bench/kernels_attention.py --quick ;;   # + ptxas's register counts
    attention)   step attention 420 python3 bench/kernels_attention.py ;;
    moe-model)   step moe-model 90 python3 -m pytest -q -p no:cacheprovider \
                   tests/model/test_moe.py -k kernel ;;
    moe)         step moe 330 python3 bench/kernels_moe.py ;;
    invariance-31) step invariance-31 200 python3 -m pytest -q -p no:cacheprovider \
                   tests/engine/test_batch_invariance.py -k 7_and_31 ;;
    mhc)         step mhc 90 python3 -m pytest -q -p no:cacheprovider tests/model/test_mhc.py ;;
    kernels-ws)  step kernels-ws 150 python3 -m pytest -q -p no:cacheprovider \
                   tests/kernels/test_grouped_gemm.py tests/kernels/test_invariant_gemm.py -k "warp or tile_shape or layout or default_configs" ;;
    invariance)  step invariance 500 python3 -m pytest -q -p no:cacheprovider \
                   tests/engine/test_batch_invariance.py -k "not computes_the_same_model" ;;
    invariance-kernels) step invariance-kernels 300 python3 -m pytest -q -p no:cacheprovider \
                   tests/engine/test_batch_invariance.py -k "kernels or 7_and_31" ;;
    invariance-kernel-dims) step invariance-kernel-dims 300 python3 -m pytest -v -p no:cacheprovider \
                   tests/engine/test_batch_invariance.py -k kernels ;;   # the kernels really in the step
    invariance-kernels-untiled) step invariance-kernels-untiled 250 python3 -m pytest -v \
                   -p no:cacheprovider tests/engine/test_batch_invariance.py \
                   -k "kernels and untiled" ;;   # the GPU default's formulation, with and without split K
    invariance-last) step invariance-last 185 python3 -m pytest -v -p no:cacheprovider \
                   tests/engine/test_batch_invariance.py \
                   -k "(kernels and untiled and not split) or 7_and_31" ;;   # a short device budget's pick
    invariance8) DEEPINFER_INVARIANT_TILE=8 step invariance8 500 python3 -m pytest -q \
                   -p no:cacheprovider tests/engine/test_batch_invariance.py \
                   -k "not computes_the_same_model" ;;
    bi-bench8)   DEEPINFER_INVARIANT_TILE=8 step bi-bench8 240 python3 bench/batch_invariant.py \
                   --v4-flash-layers 2 --prefill 8192 --decode-batch 64 --buckets 64 256 ;;
    bi-bench)    step bi-bench 330 python3 bench/batch_invariant.py --v4-flash-layers 2 \
                   --prefill 8192 --decode-batch 64 --buckets 64 256 ;;
    bi-bench-nosplit) DEEPINFER_INVARIANT_SPLIT_K=0 step bi-bench-nosplit 330 python3 \
                   bench/batch_invariant.py --v4-flash-layers 2 --prefill 8192 --decode-batch 64 \
                   --buckets 64 256 ;;   # the dense GEMM without split K (api.invariant_split_k)
    gemm-new)    step gemm-new 150 python3 -m pytest -q -p no:cacheprovider \
                   tests/kernels/test_grouped_gemm.py tests/kernels/test_invariant_gemm.py -k "split or batched or tile_shape or dense_gemm" ;;
    invariant-linears) step invariant-linears 200 python3 bench/invariant_linears.py ;;
    bi-profile-prefill) step bi-profile-prefill 200 python3 bench/step_profile.py \
                   --v4-flash-layers 2 --prefill 8192 --chunk 256 --steps 10 --out /tmp/bpp \
                   --batch-invariant ;;   # the invariant mode's prefill chunk, kernels by name
    bi-bench-tiled) DEEPINFER_INVARIANT_UNTILED=0 step bi-bench-tiled 330 python3 \
                   bench/batch_invariant.py --v4-flash-layers 2 --prefill 8192 --decode-batch 64 \
                   --buckets 64 256 ;;   # the attention segments in row tiles (invariant.untiled_segments)
    speculative) step speculative 420 python3 bench/speculative.py --buckets 16 64 256 ;;  # cold: 5 min compiling
    prefix)      step prefix 200 python3 bench/prefix_cache.py --v4-flash-layers 2 \
                   --prefix 16384 --chunk 2048 --buckets 16 128 512 2048 --repeats 2 ;;
    e2e)         step e2e 520 python3 bench/e2e.py --peer-timeout 150 ;;   # carry transformers 5.23
    profile)     step profile 360 sh -c 'python3 bench/step_profile.py --batch 1 --budget 16 \
                   --context 128 --out /tmp/profile-tiny && python3 bench/step_profile.py \
                   --v4-flash-layers 2 --context 4096 --batch 16 --out /tmp/profile-v4 && \
                   python3 bench/step_profile.py --v4-flash-layers 2 --context 128 --batch 256 \
                   --steps 20 --out /tmp/profile-v4-b256' ;;   # b256: the sampler's sort
    settle1|settle0) DEEPINFER_SETTLE_INDICES=${name#settle} step profile-prefill-$name 150 \
                   python3 bench/step_profile.py --v4-flash-layers 2 --prefill 8192 --steps 5 \
                   --out /tmp/pp-$name ;;   # index arrays settled before wide gathers (common.settled) or not
    decode-ab)   for impl in mosaic_gpu reference; do DEEPINFER_KERNEL_SINKHORN=$impl step \
                   decode-sinkhorn-$impl 200 python3 bench/step_profile.py --v4-flash-layers 2 \
                   --context 4096 --batch 16 --steps 30 --out /tmp/da-$impl; done ;;   # e2e's
                   # batch 16 lost 15% since 5c172ea: the mHC Sinkhorn kernel (GPU default since) or not
    profile-indexer) DEEPINFER_KERNEL_INDEXER=mosaic_gpu step profile-indexer 150 python3 \
                   bench/step_profile.py --v4-flash-layers 2 --prefill 8192 --steps 5 \
                   --out /tmp/pp-indexer ;;   # the 8k prefill step with the indexer kernel
    e2e-indexer) DEEPINFER_KERNEL_INDEXER=mosaic_gpu step e2e-indexer 300 python3 bench/e2e.py \
                   --peer-python "" --name e2e-gpu-indexer-kernel ;;   # after the indexer step passes
    e2e-check)   step e2e-check 420 python3 bench/e2e.py --peer-python "" \
                   --name e2e-gpu-check ;;   # the engine alone (no HF peer): a regression check
    e2e-quick)   step e2e 260 python3 bench/e2e.py --peer-timeout 100 ;;   # warm autotune cache
    profile-prefill) step profile-prefill 300 python3 bench/step_profile.py --v4-flash-layers 2 \
                   --prefill 8192 --steps 5 --out /tmp/profile-prefill ;;   # issue 11's 8k prefill
    b1)          step b1 540 sh -c 'for args in "--batch 1 --budget 16 --context 128" \
                   "--v4-flash-layers 4 --context 4096 --batch 1" \
                   "--v4-flash-layers 2 --context 4096 --batch 16"; do echo "== $args"; \
                   python3 bench/step_profile.py $args --steps 30 --out /tmp/b1; done' ;;  # the
                   # host-bound batches, with each one's device kernels ranked
    profile-invariant) step profile-invariant 220 python3 bench/step_profile.py \
                   --v4-flash-layers 2 --context 1024 --batch 64 --steps 20 --out /tmp/pi \
                   --batch-invariant ;;   # where the invariant mode's decode loses (issue 7)
    bi-profile)  step bi-profile 360 sh -c 'for mode in "" --batch-invariant; do echo "== $mode"; \
                   python3 bench/step_profile.py --v4-flash-layers 2 --context 1024 --batch 64 \
                   --steps 20 --out /tmp/bp $mode; python3 bench/step_profile.py \
                   --v4-flash-layers 2 --prefill 8192 --chunk 256 --steps 10 --out /tmp/bpp $mode; \
                   done' ;;   # bi-bench's two cases in both modes, each with its kernels ranked
    regression)  for case in "old-5c172ea decode" ". decode" "old-5c172ea prefill" ". prefill"; do
                   set -- $case; tag=head; [ $1 = . ] || tag=${1#old-}; if [ $2 = decode ]; then limit=150; args="--context 1024 \
                   --batch 64 --steps 20"; else limit=130; args="--prefill 8192 --steps 5"; fi
                   step regression-$2-$tag $limit sh -c "cd $1 && python3 bench/step_profile.py \
                   --v4-flash-layers 2 $args --out /tmp/r-$2-$tag"; done ;;   # default mode,
                   # an older commit vs this tree (prepare it here, untracked: git archive 5c172ea
                   # deepinfer_jax pallas_kernels bench configs | tar -x -C old-5c172ea; then copy
                   # bench/step_profile.py over its own; step-profile-gpu.md)
    diag-invariant) for free in 1 0; do DEEPINFER_INVARIANT_FREE_TILES=$free step \
                   diag-invariant-$free 220 python3 bench/step_profile.py --v4-flash-layers 1 \
                   --context 1024 --batch 64 --steps 10 --batch-invariant; done ;;
    launcher-ab) step launcher-ab 400 sh -c 'for case in "64 1024" "1 4096"; do set -- $case; \
                   python3 bench/step_profile.py --v4-flash-layers 2 --batch $1 --context $2 \
                   --steps 30 --launch-ab; done' ;;   # thread on vs off (64 x 4k context: 1,024 prefill steps)
    ring-writes) step ring-writes 150 python3 bench/ring_writes.py ;;   # the cache writes' forms
    dense)       step dense 200 python3 bench/kernels_moe.py --dense-only ;;  # invariant GEMM sweep
    cmdbuf)      step cmdbuf 360 sh -c 'for flags in "" "--xla_gpu_graph_min_graph_size=1 \
                   --xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL"; \
                   do echo "XLA_FLAGS=$flags"; XLA_FLAGS="$XLA_FLAGS $flags" python3 bench/step_profile.py \
                   --v4-flash-layers 4 --context 4096 --batch 1 --steps 30 --out /tmp/cmdbuf; \
                   done' ;;   # batch 1 is launch-bound: its kernels ranked, and XLA's CUDA graphs
                   # over the whole step (default: fusions, cuBLAS, custom calls; graphs of >= 5)
    b1-v4)       step b1-v4 200 python3 bench/step_profile.py --v4-flash-layers 4 --context 4096 \
                   --batch 1 --steps 30 --out /tmp/b1-v4 ;;   # issue 11's batch 1, kernels ranked
    b1-ab)       step b1-ab 220 sh -c 'for flags in "" "--xla_gpu_enable_command_buffer="; do \
                   echo "XLA_FLAGS=$flags"; XLA_FLAGS="$XLA_FLAGS $flags" python3 \
                   bench/step_profile.py --v4-flash-layers 4 --context 4096 --batch 1 --steps 30; \
                   done' ;;   # batch 1's host-bound call: a reused plan buffer; no CUDA graphs
    persistent-tests) step persistent-tests 90 python3 -m pytest -q -p no:cacheprovider \
                   tests/kernels/test_grouped_gemm.py tests/kernels/test_invariant_gemm.py -k persistent ;;
    dense-tests) step dense-tests 240 python3 -m pytest -q -p no:cacheprovider \
                   tests/kernels/test_grouped_gemm.py tests/kernels/test_invariant_gemm.py tests/model/test_moe.py \
                   -k "persistent or padding or past or dense or split or tile_shape or kernel" ;;
    ws-tests)    step ws-tests 200 python3 -m pytest -q -p no:cacheprovider \
                   tests/kernels/test_grouped_gemm.py tests/kernels/test_invariant_gemm.py tests/model/test_moe.py -k \
                   "warp_specialized or tile_shape or persistent or split_k_follows or padding or untiled" ;;
    grouped-diag) step grouped-diag 300 python3 bench/grouped_diag.py ;;  # grouped GEMM's losses
    grouped-tests) step grouped-tests 200 python3 -m pytest -q -p no:cacheprovider \
                   tests/kernels/test_grouped_gemm.py ;;   # the grouped GEMM's file, compiled
    hlo)         step hlo 200 sh -c 'XLA_FLAGS="--xla_dump_to=/tmp/hlo --xla_dump_hlo_as_text \
                   --xla_dump_hlo_module_re=.*wired_step.*" python3 bench/step_profile.py \
                   --batch 1 --budget 16 --context 128 --steps 5; \
                   cp /tmp/hlo/*wired_step*after_optimizations.txt "$OUT/"' ;;  # launches by op
    *) echo "unknown step $name" ;;
  esac
done
cat "$LOGS/steps.txt"
