#!/usr/bin/env bash
# The main job: set up, then train the default workload (the seeds' medium MLP on
# the synthetic regression set) data-parallel on 2 CPU ranks, with a progress bar
# and a summary. Extra arguments go to `mgpu train`.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
source scripts/mpi_env.sh
mkdir -p out
mpirun -np 2 --bind-to none .venv/bin/python -m mgpu train --model medium --epochs 10 \
  --json out/demo.json --save out/demo-params.npz "$@"
