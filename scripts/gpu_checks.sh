#!/usr/bin/env bash
# Every GPU check of vgraph in one go, written for the device tool (one command, at most 10
# minutes, a bare machine each time; /work/.library/device/README.md, ../shared/gpu/README.md).
#
#   here:  bash ../shared/gpu/fetch-wheels.sh .gpu-wheels      (the server's deps, ~10 MB, ignored by git)
#          plus what openai 3.x imports (the server tests' client), which that script does not fetch:
#          python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#            --platform manylinux2014_x86_64 -d .gpu-wheels httpx2==2.16.2 httpcore2==2.16.2 truststore==0.10.5
#          and the served load generator's client (perf/suites/serving.py), aiohttp:
#          python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#            --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --platform any -d .gpu-wheels \
#            aiohttp==3.14.5 multidict==7.2.1 yarl==1.25.1 frozenlist==1.8.0 aiosignal==1.4.0 \
#            aiohappyeyeballs==2.7.1 propcache==0.5.4 attrs==26.1.0
#   tool:  run(command="bash scripts/gpu_checks.sh", carry=[".gpu-wheels"], timeout_s=600)
#   then, on the still-warm machine, what the summary's last line names, with the time left:
#          run(command="GPU_CHECKS_BUDGET_S=200 bash scripts/gpu_checks.sh STEP ...", carry=[".gpu-wheels"])
#
# Steps, most important first (names to pass as arguments; default: all of them, in order):
#   doctor       vgraph doctor: kernels, graph capture, the engine on this GPU
#   overlap      pytest -m gpu: the overlapped loop and speculation on CUDA, graphs vs eager, the one-row GEMV ops
#                (and their fused-norm forms), the RoPE kernel
#   e2e          python -m perf run e2e --device cuda --quick (the issue's GPU targets)
#   spec-verify  python -m perf run spec-verify --device cuda --quick (8B first: a verify step vs a decode step)
#   profile      python -m perf.profile_step (0.5B, batch 1: step vs device busy time, Python and op profiles)
#   profile-8b   the same on the 8B shape
#   profile-64   the same on the 0.5B shape at batch 64 (offline 3.11 ms a step on 11-28, against
#                1.13 at batch 1: the host's share or the device's?)
#   kernels      python -m perf.decode_kernels_ab (batch-1 projections: cuBLAS vs the Triton GEMV; decode attention splits)
#   kernels-2    the same at one and two rows (batch 1 as the compiled forward pads it), config_for's GEMV only
#   kernels-norm norm kernel + GEMV against the norm-fused GEMV at one and two rows (passes/norm_linear.py:
#                whether that pass joins the defaults)
#   pdl          programmatic dependent launch (on by default on sm_90+, ops/kernels/common.py): the kernel,
#                graph and overlap GPU tests with it off (VGRAPH_PDL=0: what older GPUs run), then
#                python -m perf.env_ab (batch-1 step, both shapes, off vs on in alternating processes)
#   ab-base      python -m perf.env_ab --base ${GPU_CHECKS_BASE:-1513edd}: the batch-1 step of both shapes, this
#                checkout against that revision (the code the 11-28 H200 lease measured, PDL on) in alternating
#                processes: what the changes since, timed by no GPU yet, did together (the GEMVs' weight
#                tile loaded before the PDL wait, RoPE of q and k in one kernel, the norm + projection
#                fusion by default on rows <= 1024)
#   e2e-full     the same without --quick (not in the default list: about 15 minutes)
#   pytest-ops   pytest -m gpu tests/ops -n 8 (kernel tests: independent, small)
#   pytest-rest  pytest -m gpu on every other folder, one process (engine tests take most of the memory each)
#   ops-check    vgraph ops check --device cuda (every Triton kernel vs its reference, fp8 ones too)
#   lora-fp8     pytest -m gpu on the LoRA and fp8 tests; only when pytest-ops / pytest-rest did not pass
#   decode       python -m perf run decode --device cuda --quick
#   ops          python -m perf run ops --device cuda --quick
#
# Why it is shaped so: a call is cut at 10 minutes and only files under $OUT come back (at most
# 8 of them). So each step has its own timeout, capped by what is left of GPU_CHECKS_BUDGET_S
# (default 570 s), a step with under MIN_STEP_S left is skipped (it and any step cut by its
# timeout are named in the summary's last line, the command for the next call), a failing step
# does not stop the rest, and everything is written as it goes: $OUT/summary.txt (one line per step), $OUT/gpu_checks.log (every step's
# output), $OUT/logs.tar.gz (per-step logs, results and plots, repacked after each step) and the
# perf/results/*-cuda*.json files this run wrote. Without $OUT (run by hand) it writes to
# ./gpu-checks-out.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-checks-out}
mkdir -p "$OUT"
SUMMARY="$OUT/summary.txt"
LOG="$OUT/gpu_checks.log"
LOGDIR=$(mktemp -d /tmp/gpu-checks-logs.XXXXXX)
MARK=$(mktemp /tmp/gpu-checks-start.XXXXXX)  # the run's start: results newer than it are this run's
BUDGET_S=${GPU_CHECKS_BUDGET_S:-570}
MIN_STEP_S=${GPU_CHECKS_MIN_STEP_S:-30}
START_S=$(date +%s)
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
: >"$SUMMARY"
: >"$LOG"

say() { echo "$*" | tee -a "$SUMMARY"; }

bundle() {
  # Results this run wrote (newer than its start), to $OUT as they are and into the archive.
  local f
  for f in $(find perf/results -maxdepth 1 -name '*-cuda*' -newer "$MARK" 2>/dev/null); do
    case "$f" in *.json) cp -f "$f" "$OUT/" ;; esac
    cp -f "$f" "$LOGDIR/"
  done
  tar -czf "$OUT/logs.tar.gz.tmp" -C "$LOGDIR" . 2>/dev/null && mv -f "$OUT/logs.tar.gz.tmp" "$OUT/logs.tar.gz"
}

declare -A STATUS
SKIPPED=()

step() {  # step NAME TIMEOUT_S COMMAND...
  local name=$1 limit=$2
  shift 2
  local left=$((BUDGET_S - ($(date +%s) - START_S)))
  if ((left < MIN_STEP_S)); then
    STATUS[$name]=skipped
    SKIPPED+=("$name")
    say "$name: SKIPPED (${left} s of the ${BUDGET_S} s budget left)"
    return
  fi
  ((limit > left)) && limit=$left
  echo "===== $name (timeout ${limit} s): $*" | tee -a "$LOG"
  local t0 rc
  t0=$(date +%s)
  timeout -k 15 "$limit" "$@" 2>&1 | tee -a "$LOG" "$LOGDIR/$name.log"
  rc=${PIPESTATUS[0]}
  # The e2e suite's pass/fail lines for the issue's targets, where a reader looks first.
  [[ $name == e2e* ]] && grep -E '^(target |  .* FAILED)' "$LOGDIR/$name.log" | sed "s/^/$name: /" >>"$SUMMARY"
  if ((rc == 0)); then STATUS[$name]=pass; else STATUS[$name]=fail; fi
  local how="FAIL (exit $rc)"
  ((rc == 0)) && how=PASS
  if ((rc == 124 || rc == 137)); then
    how="TIMEOUT after ${limit} s"
    SKIPPED+=("$name")  # cut short: worth a call of its own
  fi
  say "$name: $how in $(($(date +%s) - t0)) s"
  bundle
}

setup() {
  # The server's deps as wheels (the machine has no registry), then vgraph itself, editable.
  # Every step runs under coreutils timeout, which signals the step's whole process group: a
  # perf suite's vgraph serve children go with it rather than holding the GPU's memory.
  if compgen -G ".gpu-wheels/*.whl" >/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gpu-wheels/*.whl || return 1
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  else
    echo "no .gpu-wheels/*.whl: vgraph serve, the served e2e rows and the server tests will fail"
  fi
  "$PY" -c 'import aiohttp' 2>/dev/null || echo "no aiohttp (see the top of this script): the served e2e rows will fail"
  "$PY" -m pip install -q --no-index --no-deps --no-build-isolation -e . || return 1
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  "$PY" -c 'import torch, vgraph; print("torch", torch.__version__, "cuda", torch.cuda.is_available())'
}

run_step() {
  case "$1" in
    doctor) step doctor 150 "$PY" -m vgraph.cli doctor ;;
    overlap) step overlap 150 "$PY" -m pytest -m gpu -q -p no:cacheprovider tests/engine/test_overlap_cuda.py \
      tests/compiler/test_cudagraph_gpu.py tests/ops/test_dense_linear.py tests/ops/test_rotary.py ;;
    spec-verify) step spec-verify 240 env PERF_DECODE_SHAPES=llama3-8b,qwen2.5-0.5b \
      "$PY" -m perf run spec-verify --device cuda --quick ;;
    profile) step profile 150 "$PY" -m perf.profile_step --out "$LOGDIR/profile" ;;
    profile-8b) step profile-8b 200 "$PY" -m perf.profile_step --shape llama3-8b --out "$LOGDIR/profile-8b" ;;
    profile-64) step profile-64 180 "$PY" -m perf.profile_step --batch 64 --out "$LOGDIR/profile-64" ;;
    kernels) step kernels 240 "$PY" -m perf.decode_kernels_ab ;;
    kernels-2) step kernels-2 120 "$PY" -m perf.decode_kernels_ab --rows 1,2 --chosen \
      --out perf/results/decode-kernels-cuda-rows2.json ;;
    kernels-norm) step kernels-norm 150 "$PY" -m perf.decode_kernels_ab --rows 1,2 --chosen --norm \
      --out perf/results/decode-kernels-cuda-norm.json ;;
    e2e) step e2e 400 "$PY" -m perf run e2e --device cuda --quick ;;
    pdl)
      local xdist=()
      "$PY" -c 'import xdist' 2>/dev/null && xdist=(-n 8)
      step pdl-off-tests 200 env VGRAPH_PDL=0 "$PY" -m pytest -m gpu "${xdist[@]}" -q -p no:cacheprovider tests/ops \
        tests/compiler/test_cudagraph_gpu.py tests/engine/test_overlap_cuda.py
      step pdl 300 "$PY" -m perf.env_ab --env VGRAPH_PDL=1 --rounds 1 --out perf/results/env-ab-cuda-pdl.json ;;
    ab-base) step ab-base 300 "$PY" -m perf.env_ab --base "${GPU_CHECKS_BASE:-1513edd}" --rounds 1 \
      --out perf/results/env-ab-cuda-base.json ;;
    e2e-full) step e2e-full 1500 "$PY" -m perf run e2e --device cuda ;;
    pytest-ops)  # -n 8 needs pytest-xdist (the GPU machine has it); serial without
      local xdist=()
      "$PY" -c 'import xdist' 2>/dev/null && xdist=(-n 8)
      step pytest-ops 150 "$PY" -m pytest -m gpu "${xdist[@]}" -q -p no:cacheprovider tests/ops ;;
    pytest-rest) step pytest-rest 300 "$PY" -m pytest -m gpu -q -p no:cacheprovider tests --ignore=tests/ops ;;
    ops-check) step ops-check 120 "$PY" -m vgraph.cli ops check --device cuda ;;
    lora-fp8)
      if [[ ${STATUS[pytest-ops]:-} == pass && ${STATUS[pytest-rest]:-} == pass ]]; then
        say "lora-fp8: not rerun (pytest-ops and pytest-rest passed, and hold these tests)"
      else
        step lora-fp8 150 "$PY" -m pytest -m gpu -q -p no:cacheprovider tests/ops/test_lora_op.py tests/lora \
          tests/ops/test_fp8.py tests/ops/test_kv_cache_fp8.py tests/engine/test_fp8_kv_cache.py
      fi ;;
    decode) step decode 300 "$PY" -m perf run decode --device cuda --quick ;;
    ops) step ops 240 "$PY" -m perf run ops --device cuda --quick ;;
    *) say "$1: unknown step (see the head of scripts/gpu_checks.sh)" ;;
  esac
}

STEPS=("$@")
((${#STEPS[@]})) || STEPS=(doctor overlap e2e ab-base spec-verify profile pytest-ops pytest-rest ops-check lora-fp8 decode ops)
say "gpu_checks: steps ${STEPS[*]}; budget ${BUDGET_S} s; $(date -u +%FT%TZ); commit $(git rev-parse --short HEAD 2>/dev/null)"
# In this shell, not a pipeline's subshell: its PYTHONPATH must reach every step.
# GPU_CHECKS_SKIP_SETUP=1: the environment is ready (a machine set up by hand, a dry run on CPU).
if [[ ${GPU_CHECKS_SKIP_SETUP:-0} == 1 ]]; then
  say "setup: skipped (GPU_CHECKS_SKIP_SETUP=1)"
else
  echo "===== setup" >>"$LOG"
  setup >"$LOGDIR/setup.log" 2>&1
  rc=$?
  tee -a "$LOG" <"$LOGDIR/setup.log"
  if ((rc == 0)); then say "setup: PASS"; else say "setup: FAIL (exit $rc): the steps below will likely fail too"; fi
fi
for s in "${STEPS[@]}"; do run_step "$s"; done
if ((${#SKIPPED[@]})); then
  say "next call: bash scripts/gpu_checks.sh ${SKIPPED[*]}"
fi
bundle
say "gpu_checks: done in $(($(date +%s) - START_S)) s"
