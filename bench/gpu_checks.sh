#!/usr/bin/env bash
# Every GPU check in one prepared command, for a GPU node with no internet access whose python3
# already has a CUDA torch and transformers: the gpu tests, then the profile of the decode step
# and of scoring (bench/profile_gpu.py: where the time goes, kernel tables), then the weights and
# generation benchmarks, each bounded so that one slow part cannot eat the others' time. Logs go
# to $OUT (or ./gpu-out): the profile's tables in full in $OUT/profile.log. Wheels of the
# gRPC/protobuf pins may be carried in .whl/ (README, "Development": how to download them).
#
#     bash bench/gpu_checks.sh            # one H100: at most ~10 minutes
#
# The steps' bounds add up to 570 s (TEST_GPU_S 140, PROFILE_GPU_S 60, BENCH_WEIGHTS_S 90,
# UPDATE_LATENCY_S 40, BENCH_GPU_S 220 + 20) plus the install (~20 s): under the device's 600 s
# command limit. The
# whole gpu suite outgrew 150 s (49 tests stopped at the 31st at 170 s on an H100, 16:55 UTC
# 2026-11-26: more of it compiles), so a 15-minute lease is better spent as two calls, the
# second right after the first (the machine stays warm ~30 s: no second start; a start costs
# ~60-120 s of the 15 minutes of device time per task, starts and idle included):
#
#     SKIP_STEPS="bench-weights bench-gpu update-latency" TEST_GPU_S=220 PROFILE_GPU_S=85 \
#         bash bench/gpu_checks.sh
#     SKIP_STEPS="test-gpu update-latency profile" BENCH_WEIGHTS_S=80 \
#         WEIGHTS_ARGS="--no-cpu-reference --baseline per-tensor" BENCH_GPU_S=250 \
#         BENCH_GPU_ARGS="--skip small" bash bench/gpu_checks.sh
#
# (220 + 85 and 80 + 250 s of bounds: the worst case fits 900 s of device time, each bound
# overrunning by its SIGINT grace (~15 s), the installs ~30 s a call, the start 45-120 s; call
# 2's BENCH_GPU_S may be set from `status`'s budget_left_s less ~60 s. The profile got
# 30 s more on 2026-11-27 for the shared-prefix steps it compiles and captures, two forms x the
# first layer's view and the others'; update-latency gave its 40 s: bench-weights measures the
# same lanes on the bench model; the gpu tests, those that never ran on a GPU first, may end at
# their bound before the last few). bench-gpu
# gets 250 s: its full run was estimated at ~190 s without the small request (the 17:11 UTC
# figures: HF first call 16 s, the engine's warm-up 28 s, the server process's start 38 s, the
# scoring section's six lanes), and a run whose budget ends inside the gRPC lane (the last of
# the end-to-end lanes) has no gRPC figures: the diagnostic lanes (scoring, engine thread, gRPC
# in the bench's process) now leave it 75 s (bench_gpu.py --grpc-reserve-s), since an H200 call
# of BENCH_GPU_S=175 spent it all before the gRPC lane (2026-11-27). On that H200 the first call
# took 305 s of wall time (the gpu tests 218 s, 18 of them failing fast; the profile 67 s) and
# the machine's start ~45 s. The small request is for a call with time left.
# --baseline per-tensor adds the cuda_ipc flat lane into a second server whose weights are an
# allocation each (ROLLSERVE_FLAT_WEIGHTS=0: the apply a copy per tensor, as before 2026-11-27
# 18:00); --baseline staged one that stages every update (ROLLSERVE_CUDA_IPC_IN_PLACE=0): ~30 s
# each. bench-gpu's scoring section times the engine path's
# lm_head both ways (position blocks, vocabulary chunks). With time left, a third call profiles
# the engine's levers off: PROFILE_BASELINE_ENV="ROLLSERVE_FUSED_PROJECTIONS=0
# ROLLSERVE_DECODE_ATTENTION=sdpa ROLLSERVE_SCORING_VOCAB_CHUNKS=0" with SKIP_STEPS="test-gpu
# bench-weights update-latency bench-gpu" (profile and profile-baseline: 2 x PROFILE_GPU_S).
#
# The benches' model is issue 19's and 20's case by default (bench_generation.QWEN2_05B_VOCAB
# "0.5b-issue": Qwen2-0.5B-shaped, vocab 32,000, tied, 386M parameters, 0.83 GB per update).
# Every GPU figure before 2026-11-27 was of "0.5b" (vocab 151,936, untied, 630M, 1.26 GB): add
# --model 0.5b to BENCH_GPU_ARGS, WEIGHTS_ARGS or PROFILE_ARGS to compare with them.
# In the profile, read the step with a shared-prefix attention against the plain step (both
# captured, same run): if one wins, ROLLSERVE_SHARED_PREFIX_ATTENTION=<it> is the next default.
set -u
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
# The project, unless python3 already imports this checkout (a developer's editable install,
# which a plain install would replace with a copy of the files as they are now).
if python3 -c "import pathlib, rollserve.server as s, sys; sys.exit(pathlib.Path(s.__file__).resolve().parents[1] != pathlib.Path.cwd().resolve())" 2>/dev/null; then
    echo "rollserve: this checkout is already installed (editable)" >"$OUT/install.log"
else
    python3 -m pip install -q --no-deps --no-build-isolation . >"$OUT/install.log" 2>&1 \
        || { echo "install failed"; tail -20 "$OUT/install.log"; exit 1; }
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" | tee -a "$OUT/gpu.txt"

step() {  # step NAME SECONDS COMMAND...: run with a time bound, log to $OUT/NAME.log
    local name=$1 limit=$2
    shift 2
    case " ${SKIP_STEPS:-} " in *" $name "*) echo "=== $name skipped (SKIP_STEPS)"; return;; esac
    echo "=== $name (at most ${limit}s) $(date -u +%T)"
    # SIGINT at the bound, not TERM: pytest then prints the failures it has so far (a TERM
    # left an H200 run of 2026-11-27 with a FAILED line and no traceback), a bench its
    # KeyboardInterrupt's trace and its finally blocks (its server processes stopped).
    timeout --signal=INT --kill-after=15 "$limit" "$@" >"$OUT/$name.log" 2>&1
    echo "=== $name rc=$? $(date -u +%T)"
    # What a step killed at its bound may leave running (servers the tests started in their
    # own sessions, compile workers) would take the next step's CPU and skew its host times.
    local left
    left=$(pgrep -f 'rollserve|compile_worker|pytest' | grep -vx "$$" | tr '\n' ' ')
    if [ -n "$left" ]; then
        echo "=== $name left processes behind: $left(killed)"
        kill -9 $left 2>/dev/null
    fi
    tail -n "${TAIL_LINES:-25}" "$OUT/$name.log"
}

# TEST_GPU_FILES, PROFILE_ARGS, WEIGHTS_ARGS and BENCH_GPU_ARGS narrow a rerun (e.g. BENCH_GPU_ARGS="--skip generation");
# SKIP_STEPS="bench-gpu profile" leaves whole steps out (a lease split into two shorter calls).
# The gpu tests in a fixed order (not pytest-randomly's), the files whose gpu tests never ran on a
# GPU first (TEST_GPU_FIRST; bench/RESULTS.md lists them): a bound that ends the step early then
# cuts tests that passed on a GPU before, not new ones.
first=${TEST_GPU_FIRST:-"tests/test_causal_rows.py tests/test_prefill_attention.py
    tests/test_forward_compiled.py tests/test_cuda_ipc.py tests/test_update_timings.py
    tests/test_weight_transports_gpu.py tests/test_weights_staging.py
    tests/test_weights_device_staging.py tests/test_generation_engine_gpu.py
    tests/test_decode_attention_flex.py"}
gpu_test_files=$(echo $first)
for file in tests/test_*.py; do
    case " $gpu_test_files " in *" $file "*) ;; *) gpu_test_files="$gpu_test_files $file" ;; esac
done
# shellcheck disable=SC2086
step test-gpu "${TEST_GPU_S:-140}" python3 -m pytest -v -m gpu --durations=10 -p no:cacheprovider \
    -p no:randomly ${TEST_GPU_FILES:-$gpu_test_files}
profile=${PROFILE_GPU_S:-60}  # profile_gpu.py starts no part after its budget, 10 s before the bound
# shellcheck disable=SC2086
TAIL_LINES=${PROFILE_TAIL_LINES:-12} step profile "$profile" python3 bench/profile_gpu.py --budget-s $((profile - 10)) ${PROFILE_ARGS:-}
# PROFILE_BASELINE_ENV="ROLLSERVE_FUSED_PROJECTIONS=0" (any NAME=VALUE words) profiles again
# with those switches, into profile-baseline.log: an engine lever against its baseline on the
# same machine in the same call (the switches: the README, under the exit-code table).
if [ -n "${PROFILE_BASELINE_ENV:-}" ]; then
    # shellcheck disable=SC2086
    TAIL_LINES=${PROFILE_TAIL_LINES:-12} step profile-baseline "$profile" env $PROFILE_BASELINE_ENV python3 bench/profile_gpu.py --budget-s $((profile - 10)) ${PROFILE_ARGS:-}
fi
# shellcheck disable=SC2086
step bench-weights "${BENCH_WEIGHTS_S:-90}" python3 bench/bench_gpu_weights.py ${WEIGHTS_ARGS:-}
# The fixed cost per update (291 tiny tensors: what is not bytes), per lane, cuda_ipc included.
TAIL_LINES=16 step update-latency "${UPDATE_LATENCY_S:-40}" python3 bench/bench_update_latency.py --device cuda --phases --updates 10
# Long rows' causal attention against the masked one (bench_long_rows.py, 64 rows of 2.5-5k
# columns of the model shape): only with LONG_ROWS_S set, e.g. a third call
# SKIP_STEPS="test-gpu profile bench-weights update-latency bench-gpu" LONG_ROWS_S=120.
if [ -n "${LONG_ROWS_S:-}" ]; then
    # shellcheck disable=SC2086
    step long-rows "$LONG_ROWS_S" python3 bench/bench_long_rows.py --device cuda --dtype bfloat16 \
        --hidden 896 --heads 14 --layers 24 --vocab 32000 --prompts 8 --samples 8 \
        --prompt-len 512 1024 --response-len 2048 4096 --reps 2 ${LONG_ROWS_ARGS:-}
fi
budget=${BENCH_GPU_S:-220}  # bench_gpu.py stops its own lanes in time to print its summary
# shellcheck disable=SC2086
TAIL_LINES=80 step bench-gpu $((budget + 20)) python3 bench/bench_gpu.py --budget-s "$budget" ${BENCH_GPU_ARGS:-}
