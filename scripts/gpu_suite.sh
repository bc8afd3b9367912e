#!/usr/bin/env bash
# The whole GPU job in one command: install, GPU tests, the per-layer and whole-network
# benchmarks, compute-sanitizer, the demo, fovi-vs-knnconv convergence parity and fuzzing
# (results first, so a run cut short still brings them back).
#   bash scripts/gpu_suite.sh OUTDIR GEOMETRY_DIR [WHEEL_DIR [FOVI_TESTS]]
# WHEEL_DIR: wheels installed with --no-deps before the tests, for a machine without network
# (fovi's layer and model tests: pip download --no-deps "fovi==2.4.0" trimesh hydra-core
# "omegaconf==2.3.1" timm --python-version 3.12 --only-binary=:all: -d WHEEL_DIR (timm for
# fovi's ConvNeXtV2), and
# pip wheel --no-deps "antlr4-python3-runtime==4.9.3" -w WHEEL_DIR; its other imports are
# common).
# Results (h200*.json/png, networks.json, demo.png, convergence_parity.json/png) land in OUTDIR,
# at most eight files there (what a device run brings back). In OUTDIR/logs.tar.gz: every
# stage's log, the main bench's h200.csv (the rows of h200.json), and the JSON/PNG of the
# example networks (h200_alexnet.json, h200_resnet18.json), the neighbourhood, re-layout,
# bias-gradient (grad_bias.json), torch_binned (h200_binned.*) and host-path (host*.json)
# benches, the fovi whole-model ones (h200_fovi_models.*, the depthwise families'
# h200_families_fovi_models.*, the larger sensor's h200_in128_fovi_models.*), the fovi-kernel
# bench, the pooling layers' (fovi_pools.json/png, ncu_pools.log), the stems' (h200_stems.*,
# tune_stems.json) and the gather tuner's (tune_gather.json) (the fovi_kernels and
# convergence stages need fovi, from WHEEL_DIR); each stage's exit status and time are
# summarised in OUTDIR/summary.txt.
# FOVI_TESTS: a file of fovi's own tests of the module-level kernel API (its
# tests/test_knn_cuda.py, imports pointed at knnconv.cuda), run by the fovi_api stage.
# KNNCONV_STAGES="tests bench ..." runs only the stages named (install and wheels always run).
set -uo pipefail
out=${1:?usage: gpu_suite.sh OUTDIR GEOMETRY_DIR}
geometry=${2:?usage: gpu_suite.sh OUTDIR GEOMETRY_DIR}
mkdir -p "$out/logs"
export PYTHONUNBUFFERED=1
summary=()
stage() {  # stage NAME SECONDS COMMAND...: run with a time limit, log, remember the status
  local name=$1 limit=$2
  shift 2
  if [ -n "${KNNCONV_STAGES:-}" ] && [[ " install wheels $KNNCONV_STAGES " != *" $name "* ]]; then
    return
  fi
  local start=$SECONDS
  timeout "$limit" "$@" >"$out/logs/$name.log" 2>&1
  local status=$?
  summary+=("$(printf '%-10s exit %-3s %4ss' "$name" "$status" $((SECONDS - start)))")
  printf '%s\n' "${summary[@]}" >"$out/summary.txt"
  tail -n 3 "$out/logs/$name.log"
}

stage install 120 python3 -m pip install --no-deps --no-build-isolation -e .
if [ -n "${3:-}" ]; then
  stage wheels 120 python3 -m pip install --no-deps --no-index "$3"/*.whl
fi
nvidia-smi >"$out/logs/nvidia-smi.txt" 2>&1
stage tests 480 python3 -m pytest tests -m gpu -v -p no:cacheprovider --durations=12
if [ -n "${4:-}" ]; then
  stage fovi_api 120 python3 -m pytest -v -p no:cacheprovider "$4"
fi
# every backend's half-precision error at gradient scales 1e-8 .. 1e4, against float64
stage magnitudes 120 python3 scripts/gradient_magnitudes.py --device cuda \
  --out "$out/logs/gpu_gradient_magnitudes.json"
stage bench 400 python3 -m knnconv.tools.bench --geometry "$geometry" --stems --out "$out" \
  --dtypes float16 --backends cuda,triton,auto --check --repeats 30 --warmup 3
mv -f "$out/h200.csv" "$out/logs/" 2>/dev/null
stage networks 60 python3 -m knnconv.tools.bench_networks --geometry "$geometry" --out "$out"
# the example networks' training steps, eager and under torch.compile(mode="reduce-overhead")
stage models 240 sh -c "python3 -m knnconv bench --model alexnet --batches 32,128 \
  --backends cuda --compile --repeats 10 --warmup 3 --out '$out/logs' --name h200 && \
  python3 -m knnconv bench --model resnet18 --batches 32,128 --backends cuda --compile \
  --repeats 10 --warmup 3 --out '$out/logs' --name h200"
stage bench_bf16 60 python3 -m knnconv.tools.bench --geometry "$geometry" --out "$out" \
  --dtypes bfloat16 --backends cuda,triton --name h200_bf16 --repeats 10 --warmup 2
rm -f "$out/h200_bf16.csv" "$out/h200_bf16.png"
stage memcheck 90 compute-sanitizer --tool memcheck --error-exitcode 9 python3 scripts/sanitize_kernels.py
stage racecheck 150 compute-sanitizer --tool racecheck --error-exitcode 9 \
  python3 scripts/sanitize_kernels.py
stage initcheck 90 compute-sanitizer --tool initcheck --error-exitcode 9 \
  python3 scripts/sanitize_kernels.py
stage synccheck 90 compute-sanitizer --tool synccheck --error-exitcode 9 \
  python3 scripts/sanitize_kernels.py
stage relayouts 60 python3 scripts/bench_relayouts.py "$out/logs/relayouts.json"
# the bias gradient: the triton kernel against torch's reductions and a copy of grad_y
stage grad_bias 60 python3 scripts/bench_grad_bias.py "$out/logs/grad_bias.json"
# torch_binned against cuda apart, so its time cannot cut the main bench short
stage bench_binned 120 python3 -m knnconv.tools.bench --geometry "$geometry" --out "$out/logs" \
  --dtypes float16 --backends torch_binned,cuda --modes forward,train --check --repeats 5 \
  --warmup 1 --name h200_binned
stage fovi_kernels 240 python3 scripts/bench_fovi_kernels.py "$geometry" \
  "$out/logs/fovi_kernels.json" --stems
# the image stems (fovi's and generated) on both native backends and auto, with and without
# their input gradient, eager and replayed
stage stems 150 python3 -m knnconv.tools.bench --geometry "$geometry" --stems --layers :conv1 \
  --layers layers.0.conv --layers stem --dtypes float16 --backends cuda,triton,auto \
  --modes forward,train,train_no_dx,train_graph,train_graph_no_dx --out "$out/logs" \
  --name h200_stems
# the host path of an eager call: the smallest published layer on both native backends, and a
# mid-sized one (host-bound on triton at B = 2048)
stage host 120 sh -c "python3 scripts/bench_host.py '$geometry' '$out/logs/host.json' && \
  python3 scripts/bench_host.py '$geometry' '$out/logs/host_triton.json' --backend triton && \
  python3 scripts/bench_host.py '$geometry' '$out/logs/host_triton_mid.json' --backend triton \
  --layer fovi-resnet18_a-0.5_res-64_rfmult-2:layer1.0.conv1 --batch 2048"
stage neighbourhood 120 python3 scripts/bench_neighbourhood.py "$out/logs/neighbourhood.json"
# every pooling layer of fovi's ResNet-18 and AlexNet, forward and backward against the
# copy-bandwidth floor
stage fovi_pools 120 python3 scripts/bench_fovi_pools.py "$out/logs/fovi_pools.json"
stage ncu_pools 120 ncu --section SpeedOfLight --section Occupancy --section WarpStateStats \
  --section MemoryWorkloadAnalysis -k regex:knn_pool_.*channels python3 scripts/profile_pools.py \
  alexnet layers.0.pool 512 1
stage demo 60 python3 -m knnconv demo --out "$out/demo.png"
# fovi's own ResNet-18 and AlexNet, and its ResNet-50, depthwise-separable ResNet-18 and
# ConvNeXtV2 on the same sensor: one training step as fovi runs it, accelerated, compiled, and
# a grid ResNet-18 of as many pixels (also compiled), eager and as CUDA graphs, with a GPU-time
# breakdown
stage fovi_models 480 python3 -m knnconv bench --fovi-model resnet18,alexnet,resnet50 \
  --batches 512,2048 --out "$out/logs"
stage fovi_families 480 python3 -m knnconv bench --fovi-model resnet18_dwsep,convnextv2 \
  --batches 512,2048 --out "$out/logs" --name h200_families
# a larger sensor (in_res 128, about four times the samples): step and peak memory against
# fovi's path and the grid network of as many pixels
stage fovi_large 300 python3 -m knnconv bench --fovi-model resnet18,alexnet --in-res 128 \
  --batches 512 --paths fovi,accelerated,grid --out "$out/logs" --name h200_in128
# the batch norm of a default-mode compiled step: the opaque cuDNN op against inductor's
stage compile_batch_norm 300 python3 scripts/compile_batch_norm.py \
  "$out/logs/compile_batch_norm.json" resnet18 512,2048
# where the host time of an eager step goes, accelerated and grid (cProfile, torch.profiler)
stage host_profile 150 python3 scripts/profile_fovi_host.py resnet18 128 accelerated,grid
# what is alive at the peak of a training step on that sensor, fovi's path against knnconv's
stage fovi_memory 150 python3 scripts/profile_fovi_memory.py resnet18 512 128 fovi,accelerated
# fovi's models under DistributedDataParallel at every world size the machine has
stage ddp 600 python3 scripts/ddp_scaling.py "$out/logs/ddp"
# a fovi KNNAlexNet trained through fovi's own layers and through knnconv, two seeds each
stage convergence 180 python3 scripts/convergence_parity.py --out "$out"
stage profile 60 env KNNCONV_CPROFILE=1 python3 scripts/profile_cells.py "$geometry" \
  rfmult-2:layer4.0.conv2:512 rfmult-2:layer4.0.conv2:2048 rfmult-2:conv1:2048
stage profile_triton 60 env KNNCONV_CPROFILE=1 KNNCONV_PROFILE_BACKEND=triton \
  python3 scripts/profile_cells.py "$geometry" rfmult-2:layer4.0.conv2:512 \
  rfmult-2:layer1.0.conv1:2048 rfmult-2:layers.1.conv:2048
# the few-channel kernels' tiles on the published stems
stage tune_stems 120 env KNNCONV_TUNE_FAMILIES=stem_forward,stem_grad_weight,stem_grad_input \
  python3 scripts/tune_triton.py "$geometry" "$out/logs/tune_stems.json" rfmult-2:conv1:512 \
  rfmult-2:conv1:2048 rf1:conv1:2048 rfmult-1:layers.0.conv:2048
# the triton kernels' tiles (and grad_weight's split) on published layers
stage tune_triton 300 python3 scripts/tune_triton.py "$geometry" "$out/logs/tune_triton.json" \
  rfmult-2:layer1.0.conv1:2048 rfmult-2:layer3.0.conv2:2048 rfmult-2:layer4.0.conv1:512 \
  rfmult-2:layers.1.conv:2048 rfmult-2:layers.3.conv:2048
sections="--section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats --section MemoryWorkloadAnalysis"
stage ncu 180 env KNNCONV_NCU=1 ncu $sections -k regex:knn_ -s 6 -c 4 python3 \
  scripts/profile_cells.py "$geometry" rfmult-2:conv1:2048 rfmult-1:layers.1.conv:2048
# the triton kernels, with their Triton IR (TTGIR, PTX) kept in logs/triton_cache
stage ncu_triton 180 env KNNCONV_NCU=1 KNNCONV_PROFILE_BACKEND=triton \
  TRITON_CACHE_DIR="$out/logs/triton_cache" ncu $sections -k regex:knn_conv -s 6 -c 3 \
  python3 scripts/profile_cells.py "$geometry" rfmult-2:layers.1.conv:2048
stage ncu_relayouts 120 env KNNCONV_NCU=1 ncu --section SpeedOfLight \
  --section MemoryWorkloadAnalysis --section Occupancy -k regex:transpose -c 6 python3 \
  scripts/bench_relayouts.py "$out/logs/relayouts_ncu.json"
stage fuzz 90 python3 scripts/fuzz_gpu.py --cases 2000 --seed 1 --out "$out/logs/fuzz.json"
# the channels-last gather's tiles, mma.sync against warpgroup MMA, on published layers
stage tune_gather 200 python3 scripts/tune_gather.py "$geometry" "$out/logs/tune_gather.json" \
  rfmult-2:layer1.0.conv1:2048 rfmult-2:layer2.0.conv2:2048 rfmult-2:layer3.0.conv2:2048 \
  rfmult-2:layer4.0.conv1:512 rfmult-2:layers.1.conv:2048 rfmult-2:layers.3.conv:2048
# warpgroup MMA on shared-memory operands: the descriptor convention and accumulator layout
stage wgmma_probe 60 python3 scripts/probe_wgmma.py --out "$out/logs/wgmma_probe.json"
cat "$out/summary.txt"
tar -czf "$out/logs.tar.gz" -C "$out" logs && rm -r "$out/logs"
