#!/usr/bin/env bash
# One run on a GPU machine (well under 5 minutes): versions and CUDA-awareness,
# the GPU tests, verify and train on CuPy arrays at every stage (host staging
# forced, and CUDA-aware too if the MPI is), and GPU against CPU step time.
#   bash launch/gpu_check.sh            (from the repository root)
# A machine without network: carry wheels in .whl/ (e.g. the mpich wheel);
# they are installed into /tmp/site first.
set -uo pipefail

PYTHON="${PYTHON:-python3}"
if compgen -G ".whl/*.whl" > /dev/null; then
  # --prefix, not --target: the mpich wheel's libmpi and mpiexec are data files that --target drops.
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --prefix /tmp/site .whl/*.whl || exit 1
  site=$("$PYTHON" -c 'import sys; print(f"/tmp/site/lib/python{sys.version_info[0]}.{sys.version_info[1]}/site-packages")')
  export PYTHONPATH="$site:${PYTHONPATH:-}" PATH="/tmp/site/bin:$PATH" LD_LIBRARY_PATH="/tmp/site/lib:${LD_LIBRARY_PATH:-}"
  if compgen -G ".whl/mpich-*.whl" > /dev/null; then
    export MPI4PY_MPIABI=mpich  # make a preinstalled mpi4py load the carried MPICH (checked with mpi4py 4.1)
  fi
fi
export PYTHONPATH="$PWD:${PYTHONPATH:-}" PYTHONUNBUFFERED=1
status=0
step() { echo; echo "== $*"; }

step "versions"
"$PYTHON" - <<'PY'
import cupy, mpi4py, numpy
from mpi4py import MPI
from mpizero.cuda_aware import query_cuda_support
print("numpy", numpy.__version__, "| cupy", cupy.__version__, "| CUDA runtime", cupy.cuda.runtime.runtimeGetVersion(),
      "| driver", cupy.cuda.runtime.driverGetVersion(), "| device", cupy.cuda.runtime.getDeviceProperties(0)["name"].decode())
print("mpi4py", mpi4py.__version__, "|", MPI.Get_library_version().splitlines()[0])
print("MPI CUDA-aware:", query_cuda_support())
PY

step "GPU tests"
"$PYTHON" -m pytest -q -rs tests/test_gpu.py || status=1

aware_settings=0
if "$PYTHON" -c "from mpizero.cuda_aware import query_cuda_support as q; raise SystemExit(0 if q() else 1)"; then
  aware_settings="0 1"
fi
for aware in $aware_settings; do
  for model in mlp transformer; do
    step "verify --device gpu --model $model, MPIZERO_CUDA_AWARE=$aware"
    MPIZERO_CUDA_AWARE=$aware timeout 240 mpiexec -n 2 "$PYTHON" -m mpizero verify --device gpu --model "$model" \
      --micro-batches 3 || status=1
  done
  step "train --device gpu at every stage, MPIZERO_CUDA_AWARE=$aware: --save-params must match"
  for stage in 0 1 2 3; do
    MPIZERO_CUDA_AWARE=$aware timeout 240 mpiexec -n 2 "$PYTHON" -m mpizero train --device gpu --model transformer \
      --stage "$stage" --steps 10 --log-every 10 --save-params "/tmp/gpu-$aware-$stage.npy" | grep -E "^step|held-out" \
      || status=1
  done
  sha256sum /tmp/gpu-"$aware"-*.npy
  [ "$(sha256sum /tmp/gpu-"$aware"-*.npy | awk '{print $1}' | sort -u | wc -l)" = 1 ] || { echo "MISMATCH"; status=1; }
done

for device in cpu gpu; do
  step "step time, $device: transformer width 256, 4 blocks, stage 3, 2 ranks"
  MPIZERO_CUDA_AWARE=0 timeout 240 mpiexec -n 2 "$PYTHON" -m mpizero train --device "$device" --model transformer \
    --width 256 --layers 4 --stage 3 --steps 12 --log-every 4 | grep -E "^step" || status=1
done
echo; echo "gpu_check: $([ $status = 0 ] && echo PASSED || echo FAILED)"
exit $status
