#!/usr/bin/env bash
# The one prepared GPU run, in value order, within GPU_CHECK_DEADLINE seconds (default 480: 8 minutes, the
# machine's start not counted). From the repository root:
#   bash launch/gpu_check.sh            quick, then bitwise, then bench
#   bash launch/gpu_check.sh quick      by 120 s: versions, a warm-up, the GPU against the CPU (verify --against cpu
#                                       -n 2, mlp, fp32 fp16 bf16; mpizero.torch's digests on cuda and on the CPU),
#                                       verify -n 2 (mlp, transformer), a train pair (-n 1 stage 0, -n 2 stage 3)
#                                       that must give one sha256, and a stage 3 torch model on cuda through
#                                       save/load and load_state_dict, byte for byte
#   bash launch/gpu_check.sh bitwise    by 300 s: verify --against cpu at -n 4 3 1 and the transformer at -n 2;
#                                       the torch users' models on the device at -n 2 and 1, one digest each;
#                                       verify at -n 2 4 3 1, both models, fp32 and fp16, staged (and CUDA-aware
#                                       where MPI is); train at five (n, stage, staging) and through a checkpoint
#                                       resumed at another n and stage, one sha256; the rest of test_gpu.py
#   bash launch/gpu_check.sh bench      what is left, at most GPU_CHECK_BENCH_SECONDS (default 360): benchmarks/
#                                       bench_gpu.py --profile, a JSON row per run as it ends: the 101M MLP, then
#                                       GPT-2 124M (bf16 autocast, 4 x 2 x 1024 tokens), each in plain torch, then
#                                       mpizero.torch at one rank at stages 0 and 3 (each step profiled: top ops,
#                                       kernels, copies, waits, allocations, beside the stand-in's counts), then
#                                       FSDP2 and stages 2 and 1
# The last part to run runs until the deadline; the others stop at their mark (120 s, 300 s). A command runs under
# its own timeout, cut to the time left; one that would start with under 5 s left is skipped, and named so.
# The verdict: PASSED (exit 0), FAILED naming each
# failed command (exit 1), or INCOMPLETE naming what was skipped (exit 2). A failed train run is named; the sha256
# is compared only among runs that succeeded, named.
# Logs: $OUT/gpu_check-<parts>.log as it runs ($OUT: the device tool's folder that comes back; /tmp elsewhere),
# the benchmark's rows in $OUT/bench_gpu.json, rewritten after each run.
# Any Python: PYTHON=python3 (the default) or a venv's; mpiexec is the one beside that Python, else PATH's.
# A bare machine without network: carry wheels in .whl/ (the mpich wheel at least; git-ignored); they are
# installed into $TMPDIR/gpu_check-site (/tmp/...) in that Python's own layout (lib/pythonX.Y/site-packages, or
# Debian's local/lib/pythonX.Y/dist-packages).
# GPU_CHECK_AGAINST_RANKS (default "4 3 1"): the -n of the bitwise part's MLP comparisons with the CPU.
# GPU_CHECK_VERIFY_RANKS (default "2 4 3 1"): the -n of the bitwise part's verify runs (each model and precision).
# GPU_CHECK_USERS (default: all eight): the torch users' models (tests/torch_bridge/torch_users.py) the bitwise part
# trains on the device at -n 2 and 1, one digest per model at every stage and -n (the device's own, not the CPU's).
# Rehearse on a CPU machine with GPU_CHECK_DEVICE=standin: the same commands through the device code paths, on the
# CPU stand-in for CuPy (mpizero.standin; torch's CPU tensors stand for CUDA ones); GPU_CHECK_DEVICE=cpu runs them
# on NumPy arrays and CPU torch.
set -uo pipefail

LOGS="${OUT:-/tmp}"
mkdir -p "$LOGS"
parts="${*:-quick bitwise bench}"
exec > >(tee "$LOGS/gpu_check-${parts// /-}.log") 2>&1  # everything below, as it happens: a cut run keeps its log

deadline=$((SECONDS + ${GPU_CHECK_DEADLINE:-480}))  # SECONDS: since the script started
PYTHON="${PYTHON:-python3}"
DEVICE="${GPU_CHECK_DEVICE:-gpu}"
case "$DEVICE" in  # the one place a device is described: --device of verify/train, torch's device, CuPy needed
  gpu) cli_device=gpu torch_device=cuda needs_cupy=1 ;;
  cpu) cli_device=cpu torch_device=cpu needs_cupy=0 ;;
  standin) cli_device=standin torch_device=cpu needs_cupy=0 && export MPIZERO_STANDIN=1 ;;  # mpizero.standin
  *) echo "gpu_check: GPU_CHECK_DEVICE=$DEVICE: expected gpu, standin or cpu"; exit 1 ;;
esac
for part in $parts; do
  case "$part" in quick | bitwise | bench) ;; *) echo "gpu_check: unknown part '$part': quick, bitwise or bench"; exit 1 ;; esac
done

if compgen -G ".whl/*.whl" > /dev/null; then
  site="${TMPDIR:-/tmp}/gpu_check-site"
  # --prefix, not --target: the mpich wheel's libmpi and mpiexec are data files that --target drops.
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --prefix "$site" .whl/*.whl || exit 1
  # Where pip put them: the scheme pip uses for --prefix (Debian's system Python adds local/ and dist-packages).
  read -r purelib platlib scripts data < <("$PYTHON" - "$site" <<'PY'
import sys
import sysconfig

scheme = sysconfig.get_preferred_scheme("prefix") if hasattr(sysconfig, "get_preferred_scheme") else None
paths = sysconfig.get_paths(scheme or sysconfig.get_default_scheme(), vars={"base": sys.argv[1], "platbase": sys.argv[1]})
print(paths["purelib"], paths["platlib"], paths["scripts"], paths["data"])
PY
)
  [ -d "$purelib" ] || { echo "gpu_check: pip wrote no $purelib:"; find "$site" -maxdepth 4 -type d; exit 1; }
  echo "gpu_check: .whl/ installed: modules in $purelib, programs in $scripts, libraries in $data/lib"
  export PYTHONPATH="$purelib:$platlib:${PYTHONPATH:-}" PATH="$scripts:$PATH" LD_LIBRARY_PATH="$data/lib:${LD_LIBRARY_PATH:-}"
  if compgen -G ".whl/mpich-*.whl" > /dev/null; then
    export MPI4PY_MPIABI=mpich  # make a preinstalled mpi4py load the carried MPICH (checked with mpi4py 4.1)
  fi
fi
export PYTHONPATH="$PWD:${PYTHONPATH:-}" PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1
if [ "$(nproc)" -lt 4 ]; then
  export MPIR_CVAR_ENABLE_HEAVY_YIELD=1  # more ranks than cores (a CPU rehearsal): waiting MPICH ranks sleep
fi
MPIEXEC=$("$PYTHON" -c "from mpizero.comm.job.launcher import mpiexec; print(mpiexec())") || exit 1
work=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")
trap 'rm -rf "$work"' EXIT

passed=() failed=() skipped=()
step() { echo; echo "== +$((SECONDS))s $*"; }
time_left() { left=$(((box_end < deadline ? box_end : deadline) - SECONDS)); }
passed_above() {  # passed_above NAME: true if NAME ran and passed earlier in this check
  [[ " ${passed[*]} " == *" $1 "* ]]
}
run() {  # run SECONDS NAME COMMAND...: under a timeout cut to the time left; passed, failed or skipped, by name
  local seconds=$1 name=$2 cut=0 rc
  shift 2
  time_left
  if ((left < 5)); then echo "-- $name skipped: out of time"; skipped+=("$name"); return 1; fi
  if ((seconds > left)); then seconds=$left cut=1; fi
  timeout -k 10 "$seconds" "$@"
  rc=$?
  if ((rc == 0)); then passed+=("$name"); return 0; fi
  if ((cut && (rc == 124 || rc == 137))); then
    echo "!! $name cut after $seconds s: out of time"; skipped+=("$name (cut)")
  else
    echo "!! $name failed (exit $rc)"; failed+=("$name")
  fi
  return 1
}
verify() {  # verify AWARE N MODEL PRECISION: every stage, bitwise against the single-rank reference
  if passed_above "verify-$1-$2-$3-$4"; then echo "-- verify-$1-$2-$3-$4 passed above"; return 0; fi
  step "verify -n $2 --model $3 --precision $4 (stages 0-3), MPIZERO_CUDA_AWARE=$1"
  run 90 "verify-$1-$2-$3-$4" env MPIZERO_CUDA_AWARE="$1" "$MPIEXEC" -n "$2" "$PYTHON" -m mpizero verify \
    --device "$cli_device" --model "$3" --precision "$4" --steps 3
}
against() {  # against N MODEL: verify --against cpu, fp32 fp16 bf16 at every stage: the device's bytes, the host's
  local name="against-$1-$2"
  step "verify --against cpu -n $1 --model $2 --precision all (stages 0-3): the device against the host"
  run 90 "$name" env MPIZERO_CUDA_AWARE=0 "$MPIEXEC" -n "$1" "$PYTHON" -m mpizero verify \
    --device "$cli_device" --against cpu --model "$2" --precision all --steps 3
}
bridge() {  # bridge N: mpizero.torch on the device and on the CPU (torch_against_cpu.py): the same digest lines
  local on_device="$work/bridge-device-$1.txt" on_cpu="$work/bridge-cpu-$1.txt" name="bridge-$1" script
  script=tests/torch_bridge/torch_against_cpu.py
  step "mpizero.torch on $torch_device against the CPU, -n $1: fp32, fp16, bf16 at stages 0-3"
  # shellcheck disable=SC2016  # expanded by the inner bash: its $1 is the file, the rest the command
  run 90 "$name-device" bash -c 'exec "${@:2}" > "$1"' _ "$on_device" env MPIZERO_CUDA_AWARE=0 "$MPIEXEC" -n "$1" \
    "$PYTHON" -m mpi4py "$script" "$torch_device" || return
  # shellcheck disable=SC2016  # as above
  run 90 "$name-cpu" bash -c 'exec "${@:2}" > "$1"' _ "$on_cpu" env -u MPIZERO_STANDIN "$MPIEXEC" -n "$1" \
    "$PYTHON" -m mpi4py "$script" cpu || return
  cat "$on_device"
  if ! grep -q '^digest' "$on_device" || grep '^digest' "$on_device" | grep -vxF -f "$on_cpu"; then
    echo "!! $name: the digests above differ from the CPU's (or none was printed)"; failed+=("$name"); return
  fi
  echo "-- $name: every digest the device printed is the CPU's"
}
users() {  # users N...: torch_users.py's models on the device at each -n: one digest per model, every stage and n
  # (stages 0-3 and 3 kept gathered: five digest lines a model)
  local kinds=${GPU_CHECK_USERS:-tied twice frozen nested batchnorm autocast clip gpt2} n files=() name script
  script=tests/torch_bridge/torch_users.py
  step "the torch users' models on $torch_device (${kinds}), stages 0-3 and 3 kept, at -n $*: one digest per model"
  for n in "$@"; do
    name="users-$n"
    # shellcheck disable=SC2016,SC2086  # expanded by the inner bash: its $1 is the file; the kinds are words
    run 120 "$name" bash -c 'exec "${@:2}" > "$1"' _ "$work/$name.txt" env MPIZERO_CUDA_AWARE=0 "$MPIEXEC" -n "$n" \
      "$PYTHON" -m mpi4py "$script" --device "$torch_device" $kinds || return
    files+=("$work/$name.txt")
  done
  cat "${files[0]}"
  local lines models differ
  lines=$(cat "${files[@]}" | grep -c '^digest')
  models=$(wc -w <<< "$kinds")
  differ=$(grep -h '^digest' "${files[@]}" | awk '{print $2, $4}' | sort -u | awk '{print $1}' | uniq -d | xargs)
  if ((lines != 5 * models * $#)) || [ -n "$differ" ]; then
    echo "!! users: $lines digest lines of $((5 * models * $#)); models whose bytes differ: ${differ:-none}"
    failed+=("users"); return
  fi
  echo "-- users: every model one digest at stages 0-3, 3 kept, and -n $*"
}
train_run() {  # train_run NAME AWARE STAGING N TRAIN-FLAGS...: mpizero train under run, the transformer's settings
  local name=$1 aware=$2 staging=$3 n=$4
  shift 4
  run 90 "$name" env MPIZERO_CUDA_AWARE="$aware" MPIZERO_STAGING="$staging" "$MPIEXEC" -n "$n" "$PYTHON" -m mpizero \
    train --device "$cli_device" --model transformer --log-every 3 --global-batch 8 --micro-batches 4 "$@"
}
train() {  # train AWARE N STAGE STAGING: the parameters after 6 steps, to $work/<name>.npy
  local name="train-$1-$2-$3-$4"
  if passed_above "$name"; then echo "-- $name passed above"; return 0; fi
  step "train -n $2 --stage $3, MPIZERO_STAGING=$4, MPIZERO_CUDA_AWARE=$1"
  rm -f "$work/$name.npy"
  train_run "$name" "$1" "$4" "$2" --stage "$3" --steps 6 --save-params "$work/$name.npy"
}
resumed() {  # resumed AWARE: 3 steps at -n 2 stage 3 with a checkpoint, resumed at -n 3 stage 1 to 6, to .npy
  local name="resumed-$1" directory="$work/checkpoints-$1"
  step "train: a checkpoint after 3 steps at -n 2 stage 3, resumed (resharded) at -n 3 stage 1 to step 6"
  rm -rf "$directory" "$work/$name.npy"
  train_run "checkpoint-$1" "$1" pinned 2 --stage 3 --steps 3 --checkpoint-dir "$directory" --checkpoint-every 3 &&
    train_run "$name" "$1" pinned 3 --stage 1 --steps 6 --resume "$directory" --save-params "$work/$name.npy"
}
same_train_bytes() {  # same_train_bytes NAME...: one sha256 among the runs that succeeded; the others named
  local name sums ok=() missed=()
  for name in "$@"; do
    if ! passed_above "$name"; then
      missed+=("$name")
    elif [ -s "$work/$name.npy" ]; then
      ok+=("$name")
    else
      echo "!! $name exited 0 but wrote no --save-params file"; failed+=("$name(no file)")
    fi
  done
  step "train bytes: ${ok[*]:-no run} compared${missed[*]:+; not compared (failed or skipped): ${missed[*]}}"
  if ((${#ok[@]} < 2)); then echo "-- fewer than two train runs succeeded: nothing to compare"; return; fi
  sums=$(cd "$work" && sha256sum "${ok[@]/%/.npy}")
  echo "$sums"
  if [ "$(awk '{print $1}' <<< "$sums" | sort -u | wc -l)" = 1 ]; then
    echo "-- one sha256 for ${#ok[@]} runs"
  else
    echo "!! train bytes differ among ${ok[*]}"; failed+=("train-bytes($(IFS=,; echo "${ok[*]}"))")
  fi
}
wants() { [[ " $parts " == *" $1 "* ]]; }
last=bench
wants bench || last=bitwise
wants bench || wants bitwise || last=quick
mark() {  # mark PART SECONDS: the part ends SECONDS after the start, or at the deadline if it is the last to run
  if [ "$1" = "$last" ]; then box_end=$deadline; else box_end=$2; fi
}

box_end=$deadline
step "versions ($PYTHON, $MPIEXEC, GPU_CHECK_DEVICE=$DEVICE, deadline ${GPU_CHECK_DEADLINE:-480} s)"
run 60 versions env GPU_CHECK_NEEDS_CUPY=$needs_cupy "$PYTHON" - <<'PY'
import os
import sys

import mpi4py
import numpy
from mpi4py import MPI
from mpizero.comm.cuda_aware import query_cuda_support
print("python", sys.version.split()[0], sys.executable, "| numpy", numpy.__version__)
print("mpi4py", mpi4py.__version__, "|", MPI.Get_library_version().splitlines()[0])
try:
    import torch
    print("torch", torch.__version__, "| CUDA", torch.version.cuda, "| cuda available", torch.cuda.is_available())
except ImportError:
    print("torch: absent (the round trip and the benchmark need it)")
try:
    import cupy
    rt = cupy.cuda.runtime
    print("cupy", cupy.__version__, "| CUDA runtime", rt.runtimeGetVersion(), "| driver", rt.driverGetVersion(),
          "| device", rt.getDeviceProperties(0)["name"].decode())
except Exception as error:
    if os.environ["GPU_CHECK_NEEDS_CUPY"] == "1":
        raise
    print(f"cupy: not usable here ({type(error).__name__}: {error}); not needed on this device, going on")
print("MPI CUDA-aware:", query_cuda_support())
PY
if ((needs_cupy)) && ((${#failed[@]})); then
  echo "gpu_check: FAILED: no usable CuPy, CUDA device or MPI (above); nothing else can run"
  exit 1
fi
if ((needs_cupy)); then  # compiles CuPy's kernels into its cache, so that the timeouts below time mpizero alone
  step "warm-up: verify -n 1 --model transformer --steps 1"
  run 120 warm-up "$MPIEXEC" -n 1 "$PYTHON" -m mpizero verify --device "$cli_device" --model transformer --steps 1
fi

if wants quick; then
  mark quick 120
  against 2 mlp
  bridge 2
  verify 0 2 mlp fp32
  verify 0 2 transformer fp32
  train 0 1 0 pinned
  train 0 2 3 pinned
  same_train_bytes train-0-1-0-pinned train-0-2-3-pinned
  step "a torch model on $torch_device at stage 3, -n 2: zero.save/zero.load and zero.load_state_dict"
  run 90 round-trip "$MPIEXEC" -n 2 "$PYTHON" -m mpi4py tests/torch_bridge/torch_round_trip.py "$torch_device" "$work/checkpoints"
fi

if wants bitwise; then
  mark bitwise 300
  for n in ${GPU_CHECK_AGAINST_RANKS:-4 3 1}; do against "$n" mlp; done
  against 2 transformer
  users 2 1
  aware_settings=0
  if "$PYTHON" -c "from mpizero.comm.cuda_aware import query_cuda_support as q; raise SystemExit(0 if q() else 1)"; then
    aware_settings="0 1"
  fi
  for aware in $aware_settings; do
    for n in ${GPU_CHECK_VERIFY_RANKS:-2 4 3 1}; do  # more ranks move more: -n 1 moves nothing, so it comes last
      for precision in fp32 fp16; do
        for model in mlp transformer; do
          verify "$aware" "$n" "$model" "$precision"
        done
      done
    done
    cases=("1 0 pinned" "2 3 pinned" "3 1 pinned" "4 2 pinned" "2 3 pageable")
    names=()
    for case in "${cases[@]}"; do
      read -r n stage staging <<< "$case"
      train "$aware" "$n" "$stage" "$staging"
      names+=("train-$aware-$n-$stage-$staging")
    done
    resumed "$aware"
    same_train_bytes "${names[@]}" "resumed-$aware"
    if [ "$aware" = 0 ]; then
      # test_gpu.py's verify and train tests are corners of the loops above: only the rest, for time.
      step "tests/device/test_gpu.py (the rest)"
      if "$PYTHON" -c "import pytest" 2> /dev/null; then
        run 90 test_gpu "$PYTHON" -m pytest -q -rs -p no:cacheprovider tests/device/test_gpu.py \
          -k "not verify_on_the_gpu and not byte_identical"
      else
        echo "-- test_gpu skipped: $PYTHON has no pytest"; skipped+=("test_gpu (no pytest)")
      fi
    fi
  done
fi

if wants bench; then
  mark bench "$deadline"
  step "benchmarks/bench_gpu.py: the 101M MLP, each run in its own process, a JSON row as each ends"
  rm -f "$LOGS/bench_gpu.json"
  time_left
  if ((left < 40)); then  # --budget would be under 25 s: not one run of the 101M MLP fits
    echo "-- bench_gpu skipped: out of time ($left s left)"; skipped+=("bench_gpu")
  else
    # The benchmark starts a run only while it fits in --budget (counted from its start); 15 s to spare for the
    # interpreter's start and the kill grace.
    # mpizero.torch at one rank against plain torch on both models (issue 52's targets: stages 0-2 at most 1.1x,
    # stage 3 1.25x, ahead of FSDP2), each step profiled beside the stand-in's counts of the same loop.
    bench_seconds=${GPU_CHECK_BENCH_SECONDS:-360}
    if ((left > bench_seconds)); then left=$bench_seconds; fi
    run "$left" bench_gpu "$PYTHON" benchmarks/bench_gpu.py --models mlp gpt2 --ranks 1 --steps 5 --warmup 2 \
      --timeout 90 --budget $((left - 15)) --json "$LOGS/bench_gpu.json" --profile \
      --runs torch mpizero.torch-0 mpizero.torch-3 fsdp2 mpizero.torch-2 mpizero.torch-1
  fi
  if [ -f "$LOGS/bench_gpu.json" ]; then
    not_run=$("$PYTHON" -c 'import json, sys; print(sum("skipped" in r for r in json.load(open(sys.argv[1]))["rows"]))' \
      "$LOGS/bench_gpu.json")
    if ((not_run)); then skipped+=("bench_gpu ($not_run runs)"); fi
  fi
fi

echo
echo "gpu_check: ${#passed[@]} commands passed in $SECONDS s"
if ((${#failed[@]})); then
  echo "gpu_check: FAILED: ${failed[*]}${skipped[*]:+; skipped: ${skipped[*]}}"
  exit 1
elif ((${#skipped[@]})); then
  echo "gpu_check: INCOMPLETE: nothing failed; skipped: ${skipped[*]}"
  exit 2
fi
echo "gpu_check: PASSED"
