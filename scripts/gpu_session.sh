#!/usr/bin/env bash
# One device call on a lent GPU (issue 38): installs what scripts/gpu_prepare.sh carried (.gpu-carry: the
# cp312 mgpu wheel built with CUDA, mpi4py, Open MPI, OpenBLAS), checks that mgpu sees CUDA, cuBLAS,
# NCCL 2.28.9 and a GPU (else builds mgpu there), then runs the stages in order of value, each under
# `timeout`, none starting after MGPU_SESSION_DEADLINE s (450), packing everything into $OUT/results.tgz
# after each, so a call cut short still brings back all it did:
#   OUT=DIR bash scripts/gpu_session.sh [--carry DIR] [--list] [STAGE...]
#   default stages: install env tests bench topo sanitize trace stress report; others: build (mgpu from
#   source there), explain, sheet, topo2 (docs/gpu-results.md)
# $OUT gets at most 6 files: results.tgz (every log, JSON, junit, nvidia-smi samples), summary.txt,
# session.log, trace-gpu.png, gpu-results-section.md, MANIFEST.txt.
# Dry run without a GPU (the emulation stands in for it, every figure marked EMULATED; ~10 min here):
#   OUT=/tmp/gpu-dry MGPU_EMULATE_GPU=1 bash scripts/gpu_session.sh
set -uo pipefail  # not -e: a failed stage must not stop the others
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
ROOT=$PWD
CARRY=.gpu-carry
STAGES=()
DEFAULT_STAGES=(install env tests bench topo sanitize trace stress report)
while [ $# -gt 0 ]; do
  case $1 in
    --carry) CARRY=${2:?--carry needs a directory}; shift 2 ;;
    --list) echo "${DEFAULT_STAGES[*]} build explain sheet topo2"; exit 0 ;;
    -h | --help) sed -n '2,13p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    -*) echo "gpu_session: unknown option $1" >&2; exit 2 ;;
    *) STAGES+=("$1"); shift ;;
  esac
done
[ ${#STAGES[@]} -gt 0 ] || STAGES=("${DEFAULT_STAGES[@]}")
for s in "${STAGES[@]}"; do
  case " ${DEFAULT_STAGES[*]} build explain sheet topo2 " in
    *" $s "*) ;;
    *) echo "gpu_session: unknown stage $s (--list)" >&2; exit 2 ;;
  esac
done

OUT=${OUT:-/tmp/mgpu-gpu-out}
WORK=${MGPU_SESSION_WORK:-/tmp/mgpu-session}  # everything the stages write; packed into $OUT/results.tgz
SITE=/tmp/mgpu-site                           # the carried wheels, installed (--target)
OMPI_PREFIX=${MGPU_OMPI_PREFIX:-/tmp/mgpu-ompi}
DEB_ROOT=/tmp/mgpu-deb
export EMU=0
case "${MGPU_EMULATE_GPU:-}" in "" | 0) ;; *) EMU=1 ;; esac
if [ "$EMU" = 1 ]; then
  # The dry run: stages on this machine's .venv build (its GPU emulation); the carried cp312 wheel is
  # installed and loaded by a Python 3.12 (the prepare venv) to check it, but runs nothing.
  PY=${PY:-.venv/bin/python}
  INSTALL_PY=${INSTALL_PY:-.gpu-build/venv312/bin/python}
  DEADLINE=${MGPU_SESSION_DEADLINE:-780}
  END=${MGPU_SESSION_END:-840}
  MARK="EMULATED (MGPU_EMULATE_GPU=$MGPU_EMULATE_GPU: the CPU runs the CUDA code; no figure here is a GPU's)"
else
  PY=${PY:-python3}
  INSTALL_PY=${INSTALL_PY:-$PY}
  DEADLINE=${MGPU_SESSION_DEADLINE:-450}
  END=${MGPU_SESSION_END:-470}
  MARK=""
fi
for v in PY INSTALL_PY; do  # relative paths from the repository's root, as stages run elsewhere too
  [[ ${!v} == */* && ${!v} != /* ]] && printf -v "$v" '%s' "$ROOT/${!v}"
done
export PY INSTALL_PY WORK SITE OMPI_PREFIX DEB_ROOT CARRY ROOT MARK OUT
export PYTHONUNBUFFERED=1 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export OMPI_MCA_rmaps_base_oversubscribe=1 HOME=${HOME:-/root} XDG_CACHE_HOME=$WORK/cache
T0=$SECONDS
rm -rf "$WORK" && mkdir -p "$WORK" "$OUT" || exit 1
exec > >(tee -a "$OUT/session.log") 2>&1
echo "gpu_session: $(date -u +%FT%TZ) stages: ${STAGES[*]}; deadline ${DEADLINE} s, end ${END} s${MARK:+; $MARK}"
[ -f "$CARRY/MANIFEST.txt" ] && cp "$CARRY/MANIFEST.txt" "$OUT/"

if command -v nvidia-smi > /dev/null 2>&1; then  # one sample a second, for the whole call
  nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,utilization.gpu,memory.used \
    --format=csv -l 1 > "$WORK/nvidia-smi.csv" 2>&1 &
  SMI_PID=$!
  trap 'kill $SMI_PID 2> /dev/null' EXIT
else
  echo "no nvidia-smi here${MARK:+ ($MARK)}" > "$WORK/nvidia-smi.csv"
fi

pack() {  # everything so far into $OUT/results.tgz (atomically: a kill mid-pack keeps the last one)
  tar czf "$OUT/results.tgz.tmp" -C "$WORK" --exclude=cache . 2> /dev/null && mv "$OUT/results.tgz.tmp" "$OUT/results.tgz"
}

stage() {  # stage NAME CAP FUNCTION: runs FUNCTION under timeout min(CAP, END - elapsed), logs to $WORK/NAME.log
  local name=$1 cap=$2 fn=$3 el=$((SECONDS - T0)) rc t1
  if [ "$el" -ge "$DEADLINE" ]; then
    echo "=== $name: not started (${el} s >= ${DEADLINE} s)"
    printf '%-10s %-8s %5s s\n' "$name" skipped 0 >> "$WORK/summary.txt"
    return 1
  fi
  local limit=$((cap < END - el ? cap : END - el))
  echo "=== $name: at ${el} s, limit ${limit} s"
  t1=$SECONDS
  {
    [ -n "$MARK" ] && echo "$MARK"
    timeout -k 10 "$limit" bash -c "$fn"
  } > "$WORK/$name.log" 2>&1
  rc=$?
  tail -n "${TAIL:-15}" "$WORK/$name.log"
  local verdict=ok
  [ $rc -eq 0 ] || verdict="rc=$rc"
  [ $rc -eq 124 ] || [ $rc -eq 137 ] && verdict=TIMEOUT
  echo "=== $name: $verdict in $((SECONDS - t1)) s"
  printf '%-10s %-8s %5s s\n' "$name" "$verdict" "$((SECONDS - t1))" >> "$WORK/summary.txt"
  pack
  return $rc
}

# --- the stages: each a function run by `bash -c` under timeout (hence export -f) -------------------
install_carried() {
  set -e
  [ -d "$CARRY" ] || { echo "no $CARRY: run scripts/gpu_prepare.sh here and carry it"; exit 1; }
  rm -rf "$DEB_ROOT" "$SITE" /tmp/mgpu-fallback-lib && mkdir -p "$DEB_ROOT" "$SITE" /tmp/mgpu-fallback-lib
  for f in "$CARRY"/deb/*.deb; do dpkg -x "$f" "$DEB_ROOT"; done
  local bl=$DEB_ROOT/usr/lib/x86_64-linux-gnu
  # GCC's runtime libraries: the image's when it has them (newer), Debian's only where it has none
  for lib in libgfortran.so.5 libquadmath.so.0 libgomp.so.1; do
    ldconfig -p | grep -q "$lib " || ln -s "$bl/$lib" /tmp/mgpu-fallback-lib/
  done
  if [ "$(readlink -f "$CARRY/ompi")" != "$(readlink -f "$OMPI_PREFIX")" ]; then
    rm -rf "$OMPI_PREFIX" && cp -a "$CARRY/ompi" "$OMPI_PREFIX"
  fi
  "$INSTALL_PY" -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "$CARRY"/wheels/*.whl
  # CUDA's libraries as PyTorch has them (nvidia-* wheels), else the RUNPATH's toolkit
  local cudalibs
  cudalibs=$("$INSTALL_PY" - << 'EOF'
import glob, os, site
dirs = []
for sp in site.getsitepackages():
    for name in ("libnccl.so.2", "libcublas.so.13", "libcurand.so.10", "libcudart.so.13"):
        for p in glob.glob(os.path.join(sp, "nvidia", "**", name), recursive=True):
            d = os.path.dirname(p)
            if d not in dirs:
                dirs.append(d)
print(":".join(dirs))
EOF
  )
  {
    echo "export PATH=$OMPI_PREFIX/bin:\$PATH MPI4PY_MPIABI=openmpi"
    echo "export MGPU_CARRIED_LD=$OMPI_PREFIX/lib:$bl/openblas-pthread${cudalibs:+:$cudalibs}:/tmp/mgpu-fallback-lib"
    echo "export MGPU_CARRIED_PYTHONPATH=$SITE"
  } > "$WORK/carried-env.sh"
  cat "$WORK/carried-env.sh"
  check_wheel
}

check_wheel() {  # the installed mgpu: CUDA, cuBLAS, NCCL 2.28.9 and (on a GPU) a visible device
  # shellcheck disable=SC1091
  source "$WORK/carried-env.sh"
  LD_LIBRARY_PATH=$MGPU_CARRIED_LD${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} PYTHONPATH=$MGPU_CARRIED_PYTHONPATH \
    MGPU_EMULATE_GPU= "$INSTALL_PY" - << 'EOF'
import json, os, sys
import mgpu
from mpi4py import MPI
i = mgpu.build_info()
c = i["cuda"]
print(json.dumps(i, indent=1))
print("mpi4py:", MPI.Get_library_version().splitlines()[0])
need_gpu = os.environ["EMU"] != "1"
problems = [what for what, ok in [
    ("CUDA backend", c.get("compiled")),
    ("cuBLAS", c.get("cublas_loaded")),
    ("NCCL 2.28.9", c.get("nccl_loaded") == "2.28.9"),
    ("a visible GPU", c.get("device_count", 0) >= 1 or not need_gpu),
    ("Open MPI", "Open MPI" in i["mpi"].get("library", "")),
] if not ok]
print("wheel check:", "ok" if not problems else "MISSING " + ", ".join(problems),
      "" if need_gpu else "(dry run: no GPU needed)")
sys.exit(1 if problems else 0)
EOF
}

build_there() {  # the fallback: mgpu from source with the image's nvcc, NCCL wheel and the carried libraries
  set -e
  # shellcheck disable=SC1091
  source "$WORK/carried-env.sh"
  export LD_LIBRARY_PATH=$MGPU_CARRIED_LD${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  local bl=$DEB_ROOT/usr/lib/x86_64-linux-gnu pc
  pc=$bl/openblas-pthread/pkgconfig
  sed -i "s#=/usr/#=$DEB_ROOT/usr/#" "$pc/openblas.pc"
  export PKG_CONFIG_PATH=$pc CPATH=$DEB_ROOT/usr/include/x86_64-linux-gnu/openblas-pthread${CPATH:+:$CPATH}
  local nccl
  nccl=$("$INSTALL_PY" -c "import glob, site; print(([p for s in site.getsitepackages() for p in
    glob.glob(s + '/nvidia/**/include/nccl.h', recursive=True)] + [''])[0].rsplit('/include/', 1)[0])")
  [ -n "$nccl" ] || nccl=${CUDA_HOME:-/usr/local/cuda}  # no NCCL wheel: the toolkit's (this machine's)
  mkdir -p /tmp/mgpu-nccl && ln -sf "$nccl"/lib/libnccl.so.2 /tmp/mgpu-nccl/libnccl.so
  export CMAKE_ARGS="-DCMAKE_CUDA_ARCHITECTURES=90 -DMGPU_WITH_GPU_EMULATION=OFF -DMGPU_NATIVE_ARCH=OFF \
    -DMGPU_WITH_ONEDNN=OFF -DMPI_C_COMPILER=$OMPI_PREFIX/bin/mpicc -DNCCL_INCLUDE_DIR=$nccl/include \
    -DNCCL_LIBRARY=/tmp/mgpu-nccl/libnccl.so"
  export CMAKE_BUILD_PARALLEL_LEVEL=$(nproc)
  "$INSTALL_PY" -m pip install -q --no-build-isolation --no-deps --no-compile --upgrade --target "$SITE" "$ROOT"
  check_wheel
}

env_stage() {
  nvidia-smi || true
  nvidia-smi -q | grep -iE 'product name|driver version|cuda version|bus id|max clocks|power limit' || true
  nvcc --version | tail -2 || true
  compute-sanitizer --version | head -2 || true
  "$PY" --version
  "$PY" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "nccl",
    torch.cuda.nccl.version(), "gpu", torch.cuda.is_available() and torch.cuda.get_device_name())' || true
  which mpirun && mpirun --version | head -1
  "$PY" -c 'from mpi4py import MPI; print("mpi4py", MPI.Get_library_version().splitlines()[0])' || true
  "$PY" -m pip list 2> /dev/null | grep -iE '^(numpy|torch|pytest|pytest-timeout|mpi4py|nvidia-nccl|nvidia-cublas) '
  (cd /tmp && "$PY" -m mgpu info --json "$WORK/info.json" > /dev/null 2>&1; "$PY" -m mgpu info)
  nproc; lscpu | grep -E 'Model name|^CPU\(s\)'; free -g | head -2; uname -r
  cat /etc/os-release | grep PRETTY
}

tests_stage() {  # one pytest a file, most valuable first: a hang or a device fault costs that file alone
  local t=60
  [ "$EMU" = 1 ] && t=300
  # thread: a test hung in a native wait (no Python signal handler runs there) is still ended
  local flags=(--timeout="$t" --timeout-method=thread)
  "$PY" -c "import pytest_timeout" 2> /dev/null || { echo "no pytest-timeout: no per-test timeout"; flags=(); }
  local files=() f rc=0 results=()
  if [ -n "${MGPU_SESSION_TESTS:-}" ]; then  # test files (or directories), each its own pytest; no options
    read -ra files <<< "$MGPU_SESSION_TESTS"
  else
    for f in kernels training single_process resident_data nccl stress_gpu step_trace grad_compression \
      sharded_optimizer; do
      [ -f "tests/gpu/test_$f.py" ] && files+=("tests/gpu/test_$f.py")
    done
    for f in tests/gpu/test_*.py; do
      [[ " ${files[*]} " == *" $f "* ]] || files+=("$f")
    done
  fi
  for f in "${files[@]}"; do
    echo "--- $f"
    # -v: each result in the log as it ends, so a file cut short still shows what ran
    MGPU_TEST_GPU=1 "$PY" -m pytest "$f" -v -p no:cacheprovider "${flags[@]}" --durations=5 \
      --junitxml="$WORK/junit-$(basename "$f" .py).xml" -rfE 2>&1 | tee "$WORK/pytest-$(basename "$f" .py).log"
    local r=${PIPESTATUS[0]}
    results+=("$(printf '%-40s rc=%s  %s' "$f" "$r" "$(grep -E '^=+ .*(passed|failed|error|skipped)' \
      "$WORK/pytest-$(basename "$f" .py).log" | tail -1 | tr -d '=')")")
    [ $r -eq 0 ] || rc=1
  done
  echo "--- tests by file"
  printf '%s\n' "${results[@]}"
  return $rc
}

bench_stage() {  # the issue's targets: xl b1024 tf32 and bf16 >= 1.3x PyTorch eager; medium b64 graphs >= 3x
  local alone=(--device cuda --no-progress --warmup 5 --steps 20 --repeats 3)
  local common=("${alone[@]}" --compare torch)
  local xl=(--model xl --batch-sizes 1024) md=(--model medium --batch-sizes 64)
  if [ "$EMU" = 1 ]; then  # PyTorch cannot run on emulated GPUs, and xl at b1024 takes minutes a step here
    alone=(--device cuda --no-progress --warmup 1 --steps 2 --repeats 1)
    common=("${alone[@]}")
    xl=(--layers 512,1024,768,512,256,64 --batch-sizes 64)
  fi
  local rc=0
  for prec in tf32 bf16; do
    "$PY" -m mgpu bench --explain --device cuda "${xl[@]}" --precision $prec --json "$WORK/explain-xl-$prec.json" \
      > "$WORK/explain-xl-$prec.txt" || rc=1
    "$PY" -m mgpu bench "${common[@]}" "${xl[@]}" --precision $prec --json "$WORK/bench-xl-$prec.json" || rc=1
  done
  # the inputs prefetched from the host instead of held on the GPU: what the copy stream hides
  "$PY" -m mgpu bench --explain --device cuda "${xl[@]}" --precision bf16 --data-on-device off \
    --json "$WORK/explain-xl-bf16-prefetched.json" > "$WORK/explain-xl-bf16-prefetched.txt" || rc=1
  "$PY" -m mgpu bench "${alone[@]}" "${xl[@]}" --precision bf16 --data-on-device off \
    --json "$WORK/bench-xl-bf16-prefetched.json" || rc=1
  "$PY" -m mgpu bench --explain --device cuda "${md[@]}" --cuda-graph on --json "$WORK/explain-medium.json" \
    > "$WORK/explain-medium.txt" || rc=1
  "$PY" -m mgpu bench "${common[@]}" "${md[@]}" --cuda-graph on --json "$WORK/bench-medium.json" || rc=1
  return $rc
}

topo_stage() {  # the calibration, its GEMM rates against the published fit, the selector's 1-GPU error
  local rc=0
  "$PY" -m mgpu topo --device cuda --quick --out "$WORK/profile.json" --json "$WORK/topo-gpu.json" || return 1
  "$PY" -m mgpu.gemm_fit --check-profile "$WORK/topo-gpu.json" || rc=1
  local size=(--model large --batch-sizes 64,1024 --steps 10 --repeats 2)
  [ "$EMU" = 1 ] && size=(--layers 64,256,128,10 --batch-sizes 32,128 --steps 3 --repeats 1)
  "$PY" -m mgpu bench --validate-selector --profile "$WORK/profile.json" --device cuda "${size[@]}" --no-progress --json "$WORK/selector-1gpu.json" || rc=1
  return $rc
}

sanitize_stage() {  # 3 training steps under compute-sanitizer memcheck, then racecheck (the emulation's checks here)
  # graphs on and bf16 (the issue's target): step 1 runs uncaptured, step 2 is captured, 3-4 replay it
  local train=("$PY" -m mgpu train --device cuda --layers 64,256,128,10 --batch-size 128 --steps 4
    --cuda-graph on --precision bf16 --no-progress --optimizer adamw)
  if [ "$EMU" = 1 ]; then
    export MGPU_EMULATE_VIOLATIONS_FILE=$WORK/emulation-violations.txt
    : > "$MGPU_EMULATE_VIOLATIONS_FILE"
    "${train[@]}" || return 1
    echo "emulation violations: $(wc -l < "$MGPU_EMULATE_VIOLATIONS_FILE")"
    [ ! -s "$MGPU_EMULATE_VIOLATIONS_FILE" ]
    return
  fi
  local rc=0
  # memcheck: every kernel (cuBLAS's read what our arguments say); racecheck: mgpu's own kernels
  # (the shared memory of cuBLAS's is not ours to judge), all kernels where this version has no such filter
  echo "--- compute-sanitizer --tool memcheck"
  compute-sanitizer --tool memcheck --error-exitcode 3 --target-processes all "${train[@]}" || rc=1
  local filter=()
  compute-sanitizer --help 2>&1 | grep -q -- '--kernel-name' && filter=(--kernel-name kns=mgpu)
  echo "--- compute-sanitizer --tool racecheck ${filter[*]}"
  compute-sanitizer --tool racecheck "${filter[@]}" --error-exitcode 3 --target-processes all "${train[@]}" || rc=1
  return $rc
}

trace_stage() {  # a real GPU's trace (CUDA events on the compute stream) and its picture
  local steps=30 span=20:23
  [ "$EMU" = 1 ] && steps=5 span=2:4
  "$PY" -m mgpu train --device cuda --model large --steps $steps --trace "$WORK/trace-gpu.json" \
    --trace-steps $span --no-progress --cuda-graph off &&
    "$PY" scripts/trace_png.py "$WORK/trace-gpu.json" "$WORK/trace-gpu.png" &&
    cp "$WORK/trace-gpu.png" "$OUT/trace-gpu.png"
}

stress_stage() {
  "$PY" -m mgpu stress --device cuda --duration 15 --no-progress --json "$WORK/stress-gpu.json" \
    --telemetry "$WORK/telemetry-gpu"
}

report_stage() {
  local flags=()
  [ "$EMU" = 1 ] && flags=(--emulated)
  "$PY" scripts/gpu_report.py "$WORK" --no-append "${flags[@]}" && cp "$WORK/gpu-results-section.md" "$OUT/"
}

explain_stage() {  # the cost sheets of the workloads the sheet stage measures (analytic; runs nothing)
  for cfg in "medium 64 fp32 1" "large 1024 fp32 1" "large 1024 bf16 1" "large 1024 bf16 4" "xl 1024 tf32 1" \
    "xl 1024 bf16 1" "xl 1024 bf16 4"; do
    set -- $cfg
    "$PY" -m mgpu bench --explain --device cuda --model "$1" --batch-sizes "$2" --precision "$3" --accumulate "$4" \
      --json "$WORK/explain-$1-$3-$4.json"
  done
}

sheet_stage() {  # issue 12: the measured steps the cost sheet predicts
  for cfg in "medium 64 fp32 1" "large 1024 fp32 1" "large 1024 bf16 1" "large 1024 bf16 4" "xl 1024 tf32 1" \
    "xl 1024 bf16 1" "xl 1024 bf16 4"; do
    set -- $cfg
    "$PY" -m mgpu bench --device cuda --model "$1" --batch-sizes "$2" --precision "$3" --accumulate "$4" \
      --steps 50 --repeats 5 --no-progress --json "$WORK/bench-$1-$3-$4.json"
  done
}

topo2_stage() {
  NCCL_MULTI_RANK_GPU_ENABLE=1 mpirun -np 2 "$PY" -m mgpu topo --device cuda --no-save \
    --json "$WORK/topo-gpu-2ranks.json"
}

export -f install_carried check_wheel build_there env_stage tests_stage bench_stage topo_stage sanitize_stage \
  trace_stage stress_stage report_stage explain_stage sheet_stage topo2_stage

use_carried() {  # on the GPU, every later stage runs with the carried libraries and packages
  [ "$EMU" = 1 ] && return 0  # the dry run's stages use .venv's own build (system Open MPI and OpenBLAS)
  # shellcheck disable=SC1091
  source "$WORK/carried-env.sh" || return 1
  export LD_LIBRARY_PATH=$MGPU_CARRIED_LD${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  export PYTHONPATH=$MGPU_CARRIED_PYTHONPATH${PYTHONPATH:+:$PYTHONPATH}
}

for s in "${STAGES[@]}"; do
  case $s in
    install)
      if ! stage install 120 install_carried && [ "$EMU" = 0 ] && [ -f "$WORK/carried-env.sh" ]; then
        echo "gpu_session: the carried wheel does not do: building mgpu there (fallback)"
        stage build-there 300 build_there
      fi
      use_carried ;;
    build)
      [ -f "$WORK/carried-env.sh" ] || stage install 120 install_carried
      stage build-there 300 build_there
      use_carried ;;
    env) stage env 45 env_stage ;;
    tests) TAIL=40 stage tests 180 tests_stage ;;
    bench) stage bench 150 bench_stage ;;
    topo) stage topo 90 topo_stage ;;
    sanitize) stage sanitize 120 sanitize_stage ;;
    trace) stage trace 45 trace_stage ;;
    stress) stage stress 45 stress_stage ;;
    report) stage report 20 report_stage ;;
    explain) stage explain 60 explain_stage ;;
    sheet) stage sheet 300 sheet_stage ;;
    topo2) stage topo2 120 topo2_stage ;;
  esac
done
[ -n "$MARK" ] && echo "$MARK" >> "$WORK/summary.txt"
echo "total $((SECONDS - T0)) s" >> "$WORK/summary.txt"
cp "$WORK/summary.txt" "$OUT/summary.txt"
pack
echo "=== summary (files in $OUT: $(ls "$OUT" | tr '\n' ' '))"
cat "$OUT/summary.txt"
