#!/usr/bin/env bash
# Everything a lent GPU machine must show (issue 27), in one call of the device tool, from the repo
# root: correctness first (the compiled Triton kernels, tests/engine/test_cuda.py, the CUDA IPC push
# test; in parallel, timing is not their point), then the timed runs alone on the GPU (decode with
# and without CUDA graphs, the decode attention kernel, async scheduling's step time, throughput
# beside transformers on the default model's shape and a ~1B Llama, the CUDA IPC push beside a
# device copy, the 1B's decode step by kernel, three GRPO steps). Each step has a time limit and
# the whole run a deadline (BUDGET_S); steps past it are reported skipped. Writes $OUT/gpu_check.log
# (everything) and $OUT/summary.txt (a line or three per step), and prints the summary last.
# ENGINES_1B picks throughput_1b's engines (default hf,ours,ours_async).
#
#   bash benchmarks/gpu_check.sh prepare         # here, first: .whl/ and .gpu/ to carry (git-ignored)
#   bash benchmarks/gpu_check.sh                 # there: every step
#   bash benchmarks/gpu_check.sh setup graphs    # some: setup triton tests ipc_test sleep graphs attention overlap
#                                                #       ipc throughput (= throughput_135m throughput_1b) profile grpo
#
# The machine has torch, triton and transformers but not our serving dependencies: those travel as
# wheels in .whl/ (`prepare` downloads the versions .venv has, for the image's Python 3.12). The
# default model's weights (a 98 MB GGUF) exceed what a call carries, so a random-weight model of
# its exact config, with its tokenizer (.gpu/tokenizer/), stands in for it under ROLLOUT_CACHE.
set -u
cd "$(dirname "$0")/.."
if [ "${1:-}" = prepare ]; then
  mkdir -p .git/info .whl .gpu/tokenizer
  for p in /.whl/ /.gpu/; do grep -qx "$p" .git/info/exclude 2>/dev/null || echo "$p" >> .git/info/exclude; done
  # fastapi imports opentelemetry's API; the image has none of these
  for name in msgspec pyzmq fastapi starlette uvicorn pydantic pydantic_core annotated-types typing-inspection \
      opentelemetry-api; do
    version=$(.venv/bin/python -c "import importlib.metadata as m; print(m.version('$name'))") || exit 1
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
      --platform manylinux_2_26_x86_64 -d .whl "$name==$version" || exit 1
  done
  model=$(.venv/bin/python -c "from engine.default_model import default_model_path; print(default_model_path())")
  cp "$model"/{tokenizer.json,tokenizer_config.json,chat_template.jinja,generation_config.json} .gpu/tokenizer/
  echo "prepared .whl/ and .gpu/: run 'bash benchmarks/gpu_check.sh' there with carry [\".whl\", \".gpu\"]"
  exit 0
fi
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
LOG=$OUT/gpu_check.log
SUMMARY=$OUT/summary.txt
DEADLINE=$(( $(date +%s) + ${BUDGET_S:-540} ))
STEPS=${*:-setup triton tests ipc_test sleep graphs attention overlap ipc throughput profile grpo}
[[ " $STEPS " == *" throughput "* ]] && STEPS="$STEPS throughput_135m throughput_1b"
# TRITON_INTERPRET=0: compiled kernels even where tests/conftest.py finds no /dev/nvidiactl
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false TRITON_INTERPRET=0
export ROLLOUT_CACHE=/tmp/rollout-cache
MODEL=$ROLLOUT_CACHE/models/SmolLM2-135M-Instruct
BIG=/tmp/random-llama-1b
PY=python3

want() { [[ " $STEPS " == *" $1 "* ]]; }

# run NAME LIMIT_S CMD...: the command's output to $LOG, its status, time and last lines to $SUMMARY
run() {
  local name=$1 limit=$2; shift 2
  local left=$(( DEADLINE - $(date +%s) ))
  if (( left < 15 )); then echo "$name: skipped (deadline)" >> "$SUMMARY"; return; fi
  (( limit > left )) && limit=$left
  local t0=$(date +%s) tmp=$OUT/.step.$name
  timeout -k 5 "$limit" "$@" > "$tmp" 2>&1
  local rc=$?
  { echo "=== $name (rc $rc, $(( $(date +%s) - t0 )) s): $*"; cat "$tmp"; } >> "$LOG"
  { echo "$name: rc $rc, $(( $(date +%s) - t0 )) s"; grep -E "${GREP:-^$}" "$tmp" | tail -n 40; tail -n "${TAIL:-3}" "$tmp"; } >> "$SUMMARY"
  rm -f "$tmp"
}

if [ -d .whl ] && [ ! -d /tmp/site ]; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    >> "$LOG" 2>&1 || { echo "wheels did not install" | tee -a "$SUMMARY"; exit 1; }
fi
[ -d /tmp/site ] && export PYTHONPATH=/tmp/site
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}

{ date -u; nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader
  $PY -c "import torch, triton, transformers; p = torch.cuda.get_device_properties(0); \
print(f'torch {torch.__version__} triton {triton.__version__} transformers {transformers.__version__}; \
{p.name}, {p.multi_processor_count} SMs, {p.total_memory / 2**30:.0f} GiB')"; } >> "$SUMMARY" 2>&1

if want setup; then
  if [ ! -f "$MODEL/model.safetensors" ]; then
    run model_135m 120 $PY benchmarks/random_llama.py --preset smollm2-135m --dtype float32 --out "$MODEL" \
      --tokenizer .gpu/tokenizer
  fi
  if [ ! -f "$BIG/config.json" ] && { want throughput_1b || want profile; }; then
    run model_1b 180 $PY benchmarks/random_llama.py --preset 1b --dtype bfloat16 --out "$BIG" --tokenizer .gpu/tokenizer
  fi
fi

# correctness, in parallel (each its own processes on the one GPU)
pids=()
if want triton; then TAIL=2 run triton 240 $PY -m pytest -q -p no:cacheprovider -n 4 tests/kernels/test_triton.py \
  tests/kernels/test_triton_prefill.py tests/kernels/test_triton_moe.py tests/kernels/test_triton_sampling.py & pids+=($!); fi
# (-rA: the workers' captured output of passed tests too, where the measured numbers are printed)
if want tests; then GREP="^(bf16 vs|FAILED|ERROR)" TAIL=2 run tests 300 $PY -m pytest -q -rA -p no:cacheprovider -n 3 \
  tests/engine/test_cuda.py -k "not sleep" & pids+=($!); fi
if want ipc_test; then TAIL=2 run ipc_test 120 $PY -m pytest -q -p no:cacheprovider tests/engine/test_rl_control.py \
  -k cuda_ipc & pids+=($!); fi
for p in "${pids[@]}"; do wait "$p"; done
# alone: it reads the card's memory (NVML's per-process count where it has one)
if want sleep; then GREP="^(sleep|FAILED|ERROR)" TAIL=2 run sleep 120 $PY -m pytest -q -rA -p no:cacheprovider \
  tests/engine/test_cuda.py -k sleep; fi

# timed, one at a time
if want graphs; then TAIL=12 run graphs 150 $PY benchmarks/throughput.py --device cuda --engines ours,ours_eager \
  --dtypes bfloat16 --batches 1,64 --reps 2 --json "$OUT/graphs.json"; fi
if want attention; then TAIL=14 run attention 90 $PY benchmarks/kernels_attention.py --device cuda; fi
# async scheduling: the step-time change at batch 1 and 32, in process and through the core process
if want overlap; then
  TAIL=14 run overlap 200 $PY benchmarks/throughput.py --device cuda --engines ours,ours_async,ours_mp,ours_mp_async \
    --dtypes bfloat16 --batches 1,32 --reps 2 --json "$OUT/overlap.json"; fi
if want ipc; then TAIL=12 run ipc 120 $PY benchmarks/rl_cycle.py --device cuda --dtypes bfloat16 --reps 3; fi
if want throughput_135m; then TAIL=14 run throughput_135m 200 $PY benchmarks/throughput.py --device cuda --engines hf,ours \
  --dtypes bfloat16 --batches 1,32,128,256 --reps 1 --json "$OUT/throughput_135m.json"; fi
if want throughput_1b; then TAIL=16 run throughput_1b 240 $PY benchmarks/throughput.py --device cuda --model "$BIG" \
  --engines "${ENGINES_1B:-hf,ours,ours_async}" --dtypes bfloat16 --batches 1,32,128,256 --reps 1 \
  --json "$OUT/throughput_1b.json"; fi
if want profile; then TAIL=45 run profile 120 $PY benchmarks/step_profile.py --device cuda --model "$BIG" --batch 1 \
  --tokens 256 --cprofile 25 --kernels 25
  TAIL=16 run profile_async 90 $PY benchmarks/step_profile.py --device cuda --model "$BIG" --batch 1 --tokens 256 \
    --async-scheduling --kernels 12; fi
if want grpo; then TAIL=8 run grpo 180 $PY recipes/grpo_arithmetic.py --device cuda --steps 3; fi

cat "$SUMMARY"
