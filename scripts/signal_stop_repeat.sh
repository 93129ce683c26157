#!/usr/bin/env bash
# Repeats tests/test_faults.py's "SIGUSR1 to mpirun" case outside pytest and keeps the
# whole stderr of every run that does not end cleanly (pytest shows its last 3 kB):
#   bash scripts/signal_stop_repeat.sh [RUNS]     (default 40; stderr in /tmp/signal-stop-N.txt)
# glibc's checking malloc is on (MALLOC_CHECK_=3, libc_malloc_debug), so heap corruption
# aborts at once, not runs later: it found oneDNN's JIT GEMMs writing signal frames into
# the heap (csrc/core/async_signals.h) in the first run, where plain malloc showed it in 1
# of 40. OpenMPI's backtrace handler is off (OMPI_MCA_opal_signal): it can deadlock on the
# lock an aborting malloc check holds. Needs the package installed in .venv (scripts/setup.sh).
set -u
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/mpi_env.sh
malloc_debug=$(ldconfig -p | awk '/libc_malloc_debug\.so/ {print $NF; exit}')
if [ -n "$malloc_debug" ]; then
  export LD_PRELOAD="$malloc_debug" MALLOC_CHECK_=3
fi
export OMPI_MCA_opal_signal=""
runs=${1:-40}
bad=0
for i in $(seq 1 "$runs"); do
  d=$(mktemp -d)
  mpirun -np 2 --oversubscribe --bind-to none .venv/bin/python -m mgpu train --layers 50,512,512,3 \
      --batch-size 128 --optimizer adamw --dropout 0.1 --lr-schedule cosine --warmup-steps 10 --no-progress \
      --seed 5 --steps 1500 --checkpoint-dir "$d/ckpt" --checkpoint-every 5 > "$d/out" 2> "$d/err" &
  pid=$!
  for _ in $(seq 1 200); do ls "$d"/ckpt/*.npz > /dev/null 2>&1 && break; sleep 0.05; done
  sleep "0.$((RANDOM % 10))"
  kill -USR1 "$pid"
  wait "$pid"
  rc=$?
  if [ "$rc" -ne 0 ]; then
    bad=$((bad + 1))
    cp "$d/err" "/tmp/signal-stop-$i.txt"
    echo "run $i: exit $rc, stderr in /tmp/signal-stop-$i.txt"
  fi
  rm -rf "$d"
done
checks=${malloc_debug:+, with glibc malloc checks}
echo "$bad of $runs runs did not end cleanly$checks"
[ "$bad" -eq 0 ]
