#!/usr/bin/env bash
# Set up, then run the whole test suite (unit tests, and tests that launch mpirun
# with 1-3 ranks themselves). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
source scripts/mpi_env.sh
exec .venv/bin/python -m pytest tests "$@"
