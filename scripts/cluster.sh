#!/usr/bin/env bash
# Start a virtual cluster on this machine (K hosts as network namespaces, as the tests in
# tests/cluster use) and run a command on its host 0; everything is removed afterwards.
#   sudo bash scripts/cluster.sh                      2 hosts x 2 ranks train a small model
#   sudo bash scripts/cluster.sh --hosts 3 -- {mpirun} .venv/bin/python -m mgpu info
#   sudo bash scripts/cluster.sh --slow-link -- {mpirun} .venv/bin/python -m mgpu topo --quick --no-save
# {mpirun} stands for mpirun with the cluster's hostfile, rsh agent and TCP settings;
# {hostfile}, {agent} and {disk} (each host's private local disk) are replaced too.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/mpi_env.sh
PY=.venv/bin/python
[ -x "$PY" ] || PY=python3
exec "$PY" tests/cluster/vcluster.py "$@"
