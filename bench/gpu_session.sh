#!/usr/bin/env bash
# Runs named GPU steps on a lent GPU machine (the device tool), which has CUDA torch and
# triton but no package registry and no Redis. It sets up what the repo's ignored folders
# carry (DEVELOPERS.md): `.whl/` (redis, hiredis, gguf, llguidance, pytest-asyncio for
# Python 3.12), `.device-debs/` (Debian's redis 7.0) and `.device-assets/tokenizer/`
# (SmolLM2's tokenizer files, for random checkpoints of its shape). Each step has its own
# time limit and log; a failing step does not stop the others. Everything a step writes
# under bench/results/, the measured threshold files and the steps' logs (logs/NAME.txt)
# come back in $OUT/results.tgz, beside session.log (each step's last 40 lines).
#
#   bench/gpu_session.sh tests pd pool          # issue 8 and the GPU test suite
#   bench/gpu_session.sh digest                 # issue 8: GPU-computed pool checksums, tests + off/on A/B (~8 min: alone in a call)
#   bench/gpu_session.sh fp8 moe                # FP8 tuning/GEMM/decode, 1B and 8B shapes (~7 min), MoE executors
#   bench/gpu_session.sh fp8_decode             # FP8 vs bf16 decode, 1B and 8B shapes, as stored (~2 min)
#   bench/gpu_session.sh fp8_pdl                # issue 13: FP8 GEMM + quantizer with PDL off/by plan/on: tests, decode A/B (~6 min)
#   bench/gpu_session.sh moe_fp8                # issue 13's FP8 experts: tests/gpu/test_moe_fp8_gpu.py, bench.moe_fp8_bench (~5-7 min)
#   bench/gpu_session.sh engine                 # issue 10: the engine's GPU tests and benchmarks
#   bench/gpu_session.sh decode_fusions         # issue 10: skinny GEMM + fused decode attention: tests, tuned sweep (~8 min)
#   bench/gpu_session.sh pdl                    # issue 10: programmatic dependent launch: GPU tests, engine off/on A/B (~5 min)
#   bench/gpu_session.sh fusions_engine         # issue 10: the engine with neither, each and both fusions; profile (~6 min)
#   QUICK=1 bench/gpu_session.sh engine         # the same, benchmarks shortened (--quick)
#   bench/gpu_session.sh tp                     # issue 15 on nvidia-h200-x2: the TP GPU tests
#   bench/gpu_session.sh tp_bench               # issue 15: TP=1 vs TP=2, Qwen2.5-7B shape (writes a 15 GB checkpoint once; ~3 min)
#   bench/gpu_session.sh all_reduce             # issue 15: the one-shot all-reduce against NCCL by size (~1 min)
set -u
OUT=${OUT:-/tmp/gpu-session-out}
mkdir -p "$OUT" bench/results
LOG="$OUT/session.log"

python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "wheel install failed" | tee -a "$LOG"; exit 1; }
export PYTHONPATH="/tmp/site:$PWD" PYTHONUNBUFFERED=1
mkdir -p /tmp/redis-root && for f in .device-debs/*.deb; do dpkg -x "$f" /tmp/redis-root; done
export LD_LIBRARY_PATH="/tmp/redis-root/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}"
export PATH="/tmp/redis-root/usr/bin:$PATH"
TOK="$PWD/.device-assets/tokenizer"
export TIDEPOOL_TOKENIZER_DIR="$TOK"  # tests/models.py: the GGUF cannot travel
STAMP=$(date -u +%Y-%m-%dT%H:%MZ)

step() {  # step NAME LIMIT_S COMMAND...
    local name=$1 limit=$2; shift 2
    echo "== $name ($STAMP, limit ${limit}s): $*" | tee -a "$LOG"
    local t0=$SECONDS
    timeout --signal=INT --kill-after=10 "$limit" "$@" >"$OUT/$name.txt" 2>&1
    local rc=$?
    echo "== $name rc=$rc in $((SECONDS - t0)) s" | tee -a "$LOG"
    tail -n 40 "$OUT/$name.txt" >>"$LOG"
}

{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
  git log -1 --format='commit %h %s' 2>/dev/null; } | tee -a "$LOG"

for s in "$@"; do
    case $s in
        tests) step tests 200 python3 -m pytest -v -p no:cacheprovider --timeout 60 --durations=15 tests/gpu ;;
        pd) step gpu_pd 270 python3 -m bench.gpu_pd --tokenizer "$TOK" --prompt-len 2048 --requests 8 \
                --prefill-chunks 512,1024,2048 --out bench/results/gpu_pd_h100.json ;;
        pool) step pool 150 python3 bench/pool_throughput.py --redis-bin /tmp/redis-root/usr/bin \
                --redis-args "--io-threads 4" --reps 3 --markdown bench/results/pool_h100.md \
                --json bench/results/pool_h100.json ;;
        fp8) # tune the GEMM's tiles (kernels/fp8/gemm_configs.json), the threshold and figures with them, then (falling
             # through) fp8_decode
             step fp8_tune $((${FP8_TUNE_S:-125} + 25)) python3 -m bench.fp8_tune --budget-s ${FP8_TUNE_S:-125}
             step fp8_gemm 75 python3 -m bench.fp8_gemm_bench --write-threshold --out bench/results/fp8_gemm_h100.json ;&
        fp8_decode) # FP8 decode against bf16, Llama-3.2-1B's and Llama-3-8B's shapes, with the stored tiles (~2 min)
             step fp8_decode_1b 90 python3 -m bench.fp8_decode_bench --batches 1,4,16,64 --out bench/results/fp8_decode_1b.json
             step fp8_decode_8b 150 python3 -m bench.fp8_decode_bench --shape llama-3-8b --batches 1,16,64 --skip-no-skinny \
                 --out bench/results/fp8_decode_8b.json ;;
        fp8_pdl) # issue 13: kernels/fp8's quantizer and GEMM in programmatic dependent launch: the GPU
             # tests, then FP8 decode with it off (0), with the swap-AB plan (the default, "auto") and
             # with every plan (1), alternated twice
             step fp8_pdl_tests 240 python3 -m pytest -v -p no:cacheprovider --timeout 150 tests/gpu/test_fp8_gpu.py \
                 -k "pdl or engine or graph or quant"
             for r in 1 2; do
                 for p in 0 auto 1; do
                     TIDEPOOL_PDL_FP8=${p#auto} step "fp8_decode_pdl${p}_$r" 90 python3 -m bench.fp8_decode_bench \
                         --batches 1,4,16,64 --out "bench/results/fp8_decode_pdl${p}_$r.json"
                 done
             done ;;
        handoff) # the pool's rate on one Redis and 1/4-node clusters, one prompt's transfers, then the PD path
             # on one Redis and a 4-node cluster with its per-phase timeline (issue 8)
             step pool 90 python3 bench/pool_throughput.py --redis-bin /tmp/redis-root/usr/bin --models threads \
                --reps 3 --cluster-sizes 1,4 --client-processes 8 --concurrency 8 \
                --markdown bench/results/pool_h100_r6.md --json bench/results/pool_h100_r6.json
             step decode_admission 90 python3 -m bench.decode_admission --requests 12 --max-tokens 3
             step handoff_probe 60 python3 -m bench.handoff_probe --redis-bin /tmp/redis-root/usr/bin --nodes 0,4
             step gpu_pd 150 python3 -m bench.gpu_pd --tokenizer "$TOK" --prompt-len 2048 --requests 10 \
                --prefill-chunks 2048 --redis-nodes 0,4 --out bench/results/gpu_pd_h100_r8.json ;;
        digest) # issue 8: the pool checksums computed on the GPU (kernels/digest): its GPU tests, the kernel
             # against python-xxhash, then the PD path with them off and on, alternated (a 4-node cluster)
             step digest_tests 120 python3 -m pytest -v -p no:cacheprovider --timeout 120 tests/gpu/test_digest_gpu.py \
                 tests/gpu/test_engine_gpu.py -k "digest or export"
             step digest_bench 60 python3 -m bench.digest_bench --blocks 128 --reps 20 --out bench/results/digest_h100.json
             for r in 1 2; do
                 for d in off auto; do
                     step "gpu_pd_digests_${d}_$r" 100 python3 -m bench.gpu_pd --tokenizer "$TOK" --prompt-len 2048 --requests 12 \
                         --prefill-chunks 2048 --redis-nodes 4 --pool-gb 1.5 --warmup 14 --worker-args "--swap-digests $d" \
                         --out "bench/results/gpu_pd_h100_digests_${d}_$r.json"
                 done
             done ;;
        moe) step moe 240 python3 -m bench.moe_bench --write-thresholds --reps 5 --warmup 2 \
                --out bench/results/moe_bench_h100.json --markdown bench/results/moe_bench_h100.md ;;
        moe_fp8) # FP8 experts: the GPU tests, then FP8 vs bf16 grouped GEMMs and layers
             step moe_fp8_tests 240 python3 -m pytest -v -p no:cacheprovider --timeout 120 --durations=15 tests/gpu/test_moe_fp8_gpu.py
             step moe_fp8 300 python3 -m bench.moe_fp8_bench --reps 5 --warmup 2 \
                --out bench/results/moe_fp8_h100.json --markdown bench/results/moe_fp8_h100.md ;;
        engine) step engine_tests 240 python3 -m pytest -v -p no:cacheprovider --timeout 120 --durations=15 -k engine \
                    tests/gpu/test_engine_gpu.py tests/gpu/test_moe_gpu.py tests/gpu/test_fp8_gpu.py
                step gpu_engine 300 python3 -m bench.gpu_engine ${QUICK:+--quick} --out bench/results/gpu_engine_h100.json
                step async_scheduling 150 python3 -m bench.async_scheduling --device cuda --reps 2 ${QUICK:+--quick} \
                    --out bench/results/async_scheduling_h100.json ;;
        decode_fusions) # issue 10: the skinny GEMM and the fused decode attention: their kernels' tests on the GPU,
              # the skinny GEMM's sweep against cuBLAS (tiles tuned for ~150 s; writes kernels/gemv/threshold.json)
              step fusion_tests 280 python3 -m pytest -v -p no:cacheprovider --timeout 120 tests/unit/test_gemv_kernel.py \
                  tests/unit/test_attention_kernels.py tests/gpu/test_decode_fusions_gpu.py tests/gpu/test_attention_gpu.py
              step gemv_bench 280 python3 -m bench.gemv_bench --tune --tune-budget-s ${GEMV_TUNE_S:-150} --write-threshold \
                  --out bench/results/gemv_h100.json ;;
        pdl) # issue 10: programmatic dependent launch (kernels/pdl.py): its GPU tests, then the engine with it off
             # and on, alternated twice (SmolLM2 and Llama-3.2-1B shapes, ~35 s a run)
             step pdl_tests 200 python3 -m pytest -v -p no:cacheprovider --timeout 150 tests/gpu/test_pdl_gpu.py \
                 tests/gpu/test_decode_fusions_gpu.py
             for r in 1 2; do
                 for p in 0 1; do
                     TIDEPOOL_PDL=$p step "gpu_engine_pdl${p}_$r" 100 python3 -m bench.gpu_engine --quick \
                         --shapes smollm2-135m,llama-3.2-1b --out "bench/results/gpu_engine_pdl${p}_$r.json"
                 done
             done ;;
        fusions_engine) # issue 10: the engine without either fusion, with each, with both (one process), then a profile
              step gpu_engine_fusions 300 python3 -m bench.gpu_engine --fusions --shapes smollm2-135m,llama-3.2-1b \
                  --out bench/results/gpu_engine_fusions_h100.json
              step gpu_profile_fused 150 python3 -m bench.gpu_profile --no-prefill ;;
        tp) step tp_tests 400 python3 -m pytest -x -v -p no:cacheprovider --timeout 300 --durations=15 tests/gpu/test_tp_gpu.py ;;  # -x: a failure's traceback comes back even if the call is cut
        all_reduce) step all_reduce 120 python3 -m bench.all_reduce_bench --out bench/results/all_reduce_h200x2.json ;;
        tp_bench) step tp_checkpoint 200 python3 -m bench.random_checkpoint qwen2.5-7b /tmp/tidepool-bench/qwen2.5-7b --device cuda
                  step tp_bench 500 python3 -m bench.tp_bench --checkpoint /tmp/tidepool-bench --out bench/results/tp_bench_h200x2.json ;;
        *) n=$((${n:-0} + 1)); step "custom$n" "${CUSTOM_S:-300}" bash -c "$s" ;;  # any other command, run as given
    esac
done

# The device tool brings back at most 8 files: the step logs travel inside the tarball (logs/).
mkdir -p /tmp/gpu-session-logs/logs && mv "$OUT"/*.txt /tmp/gpu-session-logs/logs/ 2>/dev/null
tar czf "$OUT/results.tgz" bench/results kernels/gemv/threshold.json kernels/fp8/swap_ab_threshold.json kernels/fp8/cublas_threshold.json kernels/fp8/gemm_configs.json \
    kernels/swiglu_gemm/threshold.json libs/model/moe/hybrid_thresholds.json -C /tmp/gpu-session-logs logs 2>/dev/null
echo "done" | tee -a "$LOG"
