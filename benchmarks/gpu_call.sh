#!/usr/bin/env bash
# One device call of the GPU session (docs/gpu.md), run on the device in the repo root:
#
#   bash benchmarks/gpu_call.sh 1    # env + correctness       (about 8.5 minutes)
#   bash benchmarks/gpu_call.sh 2    # kernels + chunking      (about 8.5 minutes)
#   bash benchmarks/gpu_call.sh 3    # runtime                 (about 8.5 minutes)
#   bash benchmarks/gpu_call.sh 4    # one 15-minute session: the engine's decode speed
#                                    # against transformers (sync and async scheduling), the
#                                    # 8B step profile, the CUDA tests of the first run's
#                                    # fixes (about 9 minutes; see docs/gpu.md)
#   bash benchmarks/gpu_call.sh 5    # CUDA graphs for decode steps: their tests, the engine
#                                    # against transformers and the 8B step with graphs, then
#                                    # decode/prefill kernels beside FlashInfer (about 7.5 min)
#   bash benchmarks/gpu_call.sh 6    # graphs on by default: their tests, the profiled 8B
#                                    # step, decode kernels replayed from a graph (about 4 min)
#   bash benchmarks/gpu_call.sh 7    # graphs of the layers only (LM head eager), one shared
#                                    # block table: their tests, the 8B step, the engine (2 min)
#   bash benchmarks/gpu_call.sh 8    # the N-way merge read in blocks of states: the Triton and
#                                    # graph tests on CUDA, decode kernels (eager, from a graph,
#                                    # FlashInfer), the engine eager against graphs (about 4 min)
#   bash benchmarks/gpu_call.sh 9    # decode and merge kernels beside FlashInfer, split-KV
#                                    # programs per SM against the number of decodes, a short
#                                    # chunk's paged prefill with and without split keys (5 min)
#
# Further arguments go to benchmarks/gpu_suite.py (e.g. `--jobs 4`, `--runtime-parts fcfs
# --profile .gpu/runtime.profile.json`). It installs the carried wheels (.whl/serve into
# /tmp/site, .whl/fi into /tmp/fi) and Medha (editable), then writes into $OUT.
# MEDHA_GPU_STAGES="chunking" (say) runs those stages instead of the call's own, with the
# call's path (to re-run one stage, or split a call that ran out of time).
# MEDHA_GPU_SKIP_INSTALL=1 skips the installs (to try the script on a developer machine).
set -uo pipefail
cd "$(dirname "$0")/.."
call=${1:?usage: bash benchmarks/gpu_call.sh 1|2|3|4|5|6|7|8|9 [gpu_suite.py arguments]}
shift
case "$call" in
    1 | 2 | 3 | 4 | 5 | 6 | 7 | 8 | 9) ;;
    *)
        echo "gpu_call: the call is 1 to 9, not $call" >&2
        exit 2
        ;;
esac
out=${OUT:-/tmp/gpu-out}
export PYTHONUNBUFFERED=1
src=""
if [ -z "${MEDHA_GPU_SKIP_INSTALL:-}" ]; then
    pip_install="python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir"
    $pip_install --target /tmp/site .whl/serve/*.whl && $pip_install --target /tmp/fi .whl/fi/*.whl \
        || { echo "gpu_call: installing the carried wheels failed" >&2; exit 1; }
    if ! $pip_install --no-build-isolation -e .; then
        echo "gpu_call: the editable install failed; using PYTHONPATH=src" >&2
        src="$PWD/src:"
    fi
    export PATH="/tmp/site/bin:$PATH"
fi
suite() { python3 benchmarks/gpu_suite.py --out "$out" "$@"; }
bounded() {  # bounded SECONDS NAME COMMAND...: run, log to $out/NAME.log, go on on failure
    local limit=$1 name=$2
    shift 2
    mkdir -p "$out"
    echo "== $name ($limit s): $*" | tee "$out/$name.log"
    local t0=$SECONDS
    timeout -k 5 "$limit" "$@" >>"$out/$name.log" 2>&1
    echo "== $name: exit $? after $((SECONDS - t0)) s" | tee -a "$out/$name.log"
}
m8b=random:benchmarks/models/llama3-8b-1m
# the 8B step profile's shape (step_profile.py), shared by calls 4-7
sp8b=(--model "$m8b" --device cuda --dtype bfloat16 --batch 8 --prompt-len 512 --new 32)
if [ -n "${MEDHA_GPU_STAGES:-}" ]; then
    path="${src}/tmp/site:/tmp/fi"
    [ "$call" = 3 ] && path="${src}/tmp/site"
    export PYTHONPATH="$path"
    status=0
    for stage in $MEDHA_GPU_STAGES; do
        suite --stage "$stage" "$@" || status=$?
    done
    exit "$status"
fi
case "$call" in
    1)
        export PYTHONPATH="${src}/tmp/site:/tmp/fi"
        suite --stage env "$@"
        suite --stage correctness "$@"
        ;;
    2)
        export PYTHONPATH="${src}/tmp/site:/tmp/fi"
        suite --stage kernels --stage chunking "$@"
        ;;
    3)  # no FlashInfer: the runtime's "auto" attention is Medha's Triton, and nothing JIT-compiles
        export PYTHONPATH="${src}/tmp/site"
        suite --stage runtime "$@"
        ;;
    4)  # no FlashInfer (nothing JIT-compiles); each part bounded, each writes its own log
        export PYTHONPATH="${src}/tmp/site"
        bounded 20 env bash -c "nvidia-smi; python3 -c 'import torch, triton; print(torch.__version__, torch.version.cuda, triton.__version__, torch.cuda.get_device_name())'"
        bounded "${MEDHA_GPU_EVT_S:-110}" evt python3 benchmarks/engine_vs_transformers.py \
            --device cuda --dtype bfloat16 --threads 4 --modes sync async
        bounded "${MEDHA_GPU_SP_ASYNC_S:-90}" sp_async python3 benchmarks/step_profile.py \
            "${sp8b[@]}" \
            --async-scheduling --no-profile --json "$out/sp_async.json"
        bounded "${MEDHA_GPU_SP_SYNC_S:-140}" sp_sync python3 benchmarks/step_profile.py \
            "${sp8b[@]}" \
            --json "$out/sp_sync.json"
        bounded "${MEDHA_GPU_TESTS_S:-170}" tests python3 -m pytest -q -n 8 --dist loadfile \
            --timeout 120 -p no:cacheprovider --junitxml="$out/tests.junit.xml" \
            tests/kernels/test_triton.py tests/parallel tests/runtime/test_distributed.py \
            tests/server/test_tp_server.py tests/runtime/test_async_scheduling.py
        ;;
    5)  # CUDA graphs; FlashInfer only for the last part (its JIT compiles are slow)
        export PYTHONPATH="${src}/tmp/site"
        bounded "${MEDHA_GPU_TESTS_S:-90}" tests python3 -m pytest -q -p no:cacheprovider \
            --timeout 80 tests/runtime/test_decode_graphs.py tests/kernels/test_api.py \
            tests/kernels/test_triton.py -k "graph or longer_rows or planned or backend"
        bounded "${MEDHA_GPU_EVT_S:-120}" evt python3 benchmarks/engine_vs_transformers.py \
            --device cuda --dtype bfloat16 --threads 4 --modes sync async graphs async-graphs
        for mode in graphs graphs_async; do
            extra=()
            [ "$mode" = graphs_async ] && extra=(--async-scheduling)
            bounded "${MEDHA_GPU_SP_S:-60}" "sp_$mode" python3 benchmarks/step_profile.py \
                "${sp8b[@]}" --cuda-graphs --no-profile "${extra[@]}"
        done
        export PYTHONPATH="${src}/tmp/site:/tmp/fi"
        bounded "${MEDHA_GPU_KERNELS_S:-100}" kernels_run python3 benchmarks/gpu_suite.py \
            --out "$out" --stage kernels --budget-s 90 --kernel-ops decode,prefill \
            --backends medha/triton,flashinfer,sdpa
        ;;
    6)  # CUDA graphs on by default (one rank); decode kernels with and without a graph
        export PYTHONPATH="${src}/tmp/site"
        bounded "${MEDHA_GPU_TESTS_S:-80}" tests python3 -m pytest -q -p no:cacheprovider \
            --timeout 70 tests/runtime/test_decode_graphs.py tests/kernels/test_api.py \
            tests/kernels/test_triton.py -k "graph or longer_rows or planned or backend"
        bounded "${MEDHA_GPU_SP_S:-75}" sp_profile python3 benchmarks/step_profile.py \
            "${sp8b[@]}" \
            --no-stacks --top 15
        export PYTHONPATH="${src}/tmp/site:/tmp/fi"
        bounded "${MEDHA_GPU_KERNELS_S:-75}" kernels_run python3 benchmarks/gpu_suite.py \
            --out "$out" --stage kernels --budget-s 65 --kernel-ops decode \
            --backends medha/triton,medha/triton-graph,flashinfer
        ;;
    7)  # the graphs' tests, the profiled 8B step, the engine eager against graphs
        export PYTHONPATH="${src}/tmp/site"
        bounded "${MEDHA_GPU_TESTS_S:-60}" tests python3 -m pytest -q -p no:cacheprovider \
            --timeout 50 tests/runtime/test_decode_graphs.py tests/runtime/test_peer_death.py
        bounded "${MEDHA_GPU_SP_S:-45}" sp_profile python3 benchmarks/step_profile.py \
            "${sp8b[@]}" \
            --no-stacks --top 10
        bounded "${MEDHA_GPU_EVT_S:-45}" evt python3 benchmarks/engine_vs_transformers.py \
            --device cuda --dtype bfloat16 --threads 4 --modes sync graphs
        ;;
    8)  # the N-way merge read in blocks; FlashInfer only for the kernels part
        export PYTHONPATH="${src}/tmp/site"
        bounded "${MEDHA_GPU_TESTS_S:-100}" tests python3 -m pytest -q -p no:cacheprovider \
            -n 4 --timeout 90 tests/kernels/test_triton.py tests/runtime/test_decode_graphs.py
        export PYTHONPATH="${src}/tmp/site:/tmp/fi"
        bounded "${MEDHA_GPU_KERNELS_S:-110}" kernels_run python3 benchmarks/gpu_suite.py \
            --out "$out" --stage kernels --budget-s 100 --kernel-ops decode \
            --backends medha/triton,medha/triton-graph,flashinfer
        export PYTHONPATH="${src}/tmp/site"
        bounded "${MEDHA_GPU_EVT_S:-60}" evt python3 benchmarks/engine_vs_transformers.py \
            --device cuda --dtype bfloat16 --threads 4 --modes sync graphs
        ;;
    9)  # the decode tiles of 2026-11-28 beside FlashInfer; programs per SM by batch size;
        # a short chunk's paged prefill with split keys (its tests on CUDA first)
        export PYTHONPATH="${src}/tmp/site"
        bounded "${MEDHA_GPU_TESTS_S:-90}" tests python3 -m pytest -q -p no:cacheprovider \
            -n 4 --timeout 80 tests/kernels/test_triton.py tests/test_benchmark_kernels.py
        export PYTHONPATH="${src}/tmp/site:/tmp/fi"
        bounded "${MEDHA_GPU_KERNELS_S:-120}" kernels_run python3 benchmarks/gpu_suite.py \
            --out "$out" --stage kernels --budget-s 110 --kernel-ops decode,merge \
            --backends medha/triton,medha/triton-graph,flashinfer
        export PYTHONPATH="${src}"
        bounded "${MEDHA_GPU_TILES_S:-120}" tiles python3 benchmarks/triton_tiles.py \
            --ops decode --graph --repeats 5 --budget-s 110 --json "$out/tiles.json" \
            --decode-shapes 1:32768,2:32768,4:32768,8:32768,16:32768,32:32768,1:131072,4:131072 \
            --decode-configs "64,4,2,2;64,4,2,4;64,4,2,8;64,4,3,8"
        bounded "${MEDHA_GPU_PAGED_S:-90}" paged_prefill python3 benchmarks/paged_prefill.py \
            --json "$out/paged_prefill.json"
        ;;
esac
