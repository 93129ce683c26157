#!/usr/bin/env bash
# Set up, then run the tests. Extra arguments go to pytest.
#   bash scripts/test.sh [pytest options]    the whole suite: the style checks of
#       scripts/lint.sh, the CPU suite (unit tests, and tests that launch mpirun with 1-3
#       ranks themselves), then tests/gpu again on two emulated GPUs (MGPU_EMULATE_GPU=2,
#       emulation/README.md); a failed style check stops the run before the tests
#   bash scripts/test.sh PATH... [options]   only those tests, in the environment given
#       (e.g. MGPU_EMULATE_GPU=1 bash scripts/test.sh tests/gpu)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
MGPU_SETUP_TORCH_PEER=1 bash scripts/setup.sh  # the tests run the PyTorch peer too
source scripts/mpi_env.sh
# The slower multi-host fault cases too (tests/cluster, ~1 min more); MGPU_CLUSTER_SLOW=0 leaves them out.
export MGPU_CLUSTER_SLOW="${MGPU_CLUSTER_SLOW:-1}"
for arg in "$@"; do
  # A path (file, directory or node id) among the arguments: run just that.
  if [[ "$arg" != -* && -e "${arg%%::*}" ]]; then
    exec .venv/bin/python -m pytest "$@"
  fi
done
bash scripts/lint.sh  # the whole suite: the style first (ruff, clang-format)
if [[ -n "${MGPU_EMULATE_GPU:-}" ]]; then
  exec .venv/bin/python -m pytest tests "$@"
fi
.venv/bin/python -m pytest tests "$@"
echo "test.sh: tests/gpu on the GPU emulation (MGPU_EMULATE_GPU=2)" >&2
MGPU_EMULATE_GPU=2 exec .venv/bin/python -m pytest tests/gpu tests/emulation "$@"
