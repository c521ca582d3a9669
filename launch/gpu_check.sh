#!/usr/bin/env bash
# The one prepared GPU run (about 8 minutes on one H200): versions and CUDA-awareness; verify --device gpu
# bitwise at -n 1-4, stages 0-3, both models, fp32 and fp16; train --device gpu --save-params byte-identical
# across rank counts, stages and staging paths; the rest of tests/test_gpu.py; benchmarks/bench_gpu.py.
#   bash launch/gpu_check.sh            (from the repository root; both parts, about 8 minutes)
#   bash launch/gpu_check.sh bitwise    (versions, verify, train, the GPU tests: about 5 minutes)
#   bash launch/gpu_check.sh bench      (versions and the benchmark: about 3.5 minutes)
# A bare machine without network: carry wheels in .whl/ (the mpich wheel at least; .whl/ is git-ignored);
# they are installed into /tmp/site first. The whole log goes to $OUT/gpu_check.log ($OUT: the device
# tool's folder that comes back; /tmp elsewhere), the benchmark's rows to $OUT/bench_gpu.json.
# Every command has its own timeout, so one hang costs minutes, not the run; the status says what failed.
# Rehearse the command lines on a CPU machine with GPU_CHECK_DEVICE=cpu (the same runs on NumPy arrays).
set -uo pipefail

LOGS="${OUT:-/tmp}"
mkdir -p "$LOGS"
parts="${*:-bitwise bench}"
exec > >(tee "$LOGS/gpu_check-${parts// /-}.log") 2>&1  # everything below, as it happens: a cut run keeps its log

PYTHON="${PYTHON:-python3}"
DEVICE="${GPU_CHECK_DEVICE:-gpu}"
if compgen -G ".whl/*.whl" > /dev/null; then
  # --prefix, not --target: the mpich wheel's libmpi and mpiexec are data files that --target drops.
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --prefix /tmp/site .whl/*.whl || exit 1
  site=$("$PYTHON" -c 'import sys; print(f"/tmp/site/lib/python{sys.version_info[0]}.{sys.version_info[1]}/site-packages")')
  export PYTHONPATH="$site:${PYTHONPATH:-}" PATH="/tmp/site/bin:$PATH" LD_LIBRARY_PATH="/tmp/site/lib:${LD_LIBRARY_PATH:-}"
  if compgen -G ".whl/mpich-*.whl" > /dev/null; then
    export MPI4PY_MPIABI=mpich  # make a preinstalled mpi4py load the carried MPICH (checked with mpi4py 4.1)
  fi
fi
export PYTHONPATH="$PWD:${PYTHONPATH:-}" PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1
failed=()
step() { echo; echo "== $(date -u +%H:%M:%S) $*"; }
run() {  # run SECONDS NAME COMMAND...: a command under a timeout; a failure is named at the end
  local seconds=$1 name=$2
  shift 2
  timeout -k 10 "$seconds" "$@" || { echo "!! $name failed (exit $?)"; failed+=("$name"); }
}

step "versions"
run 60 versions "$PYTHON" - <<'PY'
import cupy, mpi4py, numpy
from mpi4py import MPI
from mpizero.comm.cuda_aware import query_cuda_support
print("numpy", numpy.__version__, "| cupy", cupy.__version__, "| CUDA runtime", cupy.cuda.runtime.runtimeGetVersion(),
      "| driver", cupy.cuda.runtime.driverGetVersion(), "| device", cupy.cuda.runtime.getDeviceProperties(0)["name"].decode())
print("mpi4py", mpi4py.__version__, "|", MPI.Get_library_version().splitlines()[0])
print("MPI CUDA-aware:", query_cuda_support())
PY
if [ "$DEVICE" = gpu ] && [ ${#failed[@]} -gt 0 ]; then
  echo "gpu_check: FAILED: no usable CuPy, CUDA device or MPI (above); nothing else can run"
  exit 1
fi

wants() { [[ " $parts " == *" $1 "* ]]; }

aware_settings=0
if ! wants bitwise; then
  aware_settings=""
elif "$PYTHON" -c "from mpizero.comm.cuda_aware import query_cuda_support as q; raise SystemExit(0 if q() else 1)"; then
  aware_settings="0 1"
fi

for aware in $aware_settings; do
  for n in 1 2 3 4; do
    for model in mlp transformer; do
      for precision in fp32 fp16; do
        step "verify -n $n --model $model --precision $precision (stages 0-3), MPIZERO_CUDA_AWARE=$aware"
        run 90 "verify-$aware-$n-$model-$precision" env MPIZERO_CUDA_AWARE="$aware" mpiexec -n "$n" "$PYTHON" \
          -m mpizero verify --device "$DEVICE" --model "$model" --precision "$precision" --steps 3
      done
    done
  done

  step "train --device gpu --save-params: the same bytes at every rank count, stage and staging path"
  rm -f /tmp/gpu-train-*.npy
  for case in "1 0 pinned" "2 3 pinned" "3 1 pinned" "4 2 pinned" "2 3 pageable"; do
    read -r n stage staging <<< "$case"
    run 90 "train-$aware-$n-$stage-$staging" env MPIZERO_CUDA_AWARE="$aware" MPIZERO_STAGING="$staging" \
      mpiexec -n "$n" "$PYTHON" -m mpizero train --device "$DEVICE" --model transformer --stage "$stage" --steps 6 --log-every 3 \
      --global-batch 8 --micro-batches 4 --save-params "/tmp/gpu-train-$n-$stage-$staging.npy"
  done
  sha256sum /tmp/gpu-train-*.npy
  if [ "$(sha256sum /tmp/gpu-train-*.npy | awk '{print $1}' | sort -u | wc -l)" != 1 ]; then
    echo "!! train bytes differ"; failed+=("train-bytes-$aware")
  fi
done

if wants bitwise; then
  # test_gpu.py's verify and train tests are corners of the two loops above: only the rest, for time.
  step "tests/test_gpu.py (the rest)"
  run 90 test_gpu "$PYTHON" -m pytest -q -rs tests/test_gpu.py -k "not verify_on_the_gpu and not byte_identical"
fi

if wants bench; then
  step "benchmarks/bench_gpu.py: the 101M MLP (the transformer too, given time: --models mlp transformer)"
  run 210 bench_gpu "$PYTHON" benchmarks/bench_gpu.py --models mlp --ranks 1 2 --steps 5 --warmup 2 --timeout 60 \
    --runs torch ddp fsdp2 mpizero.torch-0 mpizero.torch-2 mpizero.torch-3 train --json "$LOGS/bench_gpu.json"
fi

echo
if [ ${#failed[@]} -eq 0 ]; then
  echo "gpu_check: PASSED"
else
  echo "gpu_check: FAILED: ${failed[*]}"
fi
[ ${#failed[@]} -eq 0 ]
