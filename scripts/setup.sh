#!/usr/bin/env bash
# Sets up everything mgpu needs on Debian 12 (run as root, or with sudo available):
# system packages from apt (compilers, CMake, OpenMPI, OpenBLAS, Python), a
# virtual environment at .venv on Debian's python3, Python packages from PyPI
# (mpi4py built against the system OpenMPI), and mgpu itself built into .venv.
# Idempotent: a second run only rebuilds what changed.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

APT_PACKAGES=(build-essential cmake ninja-build pkg-config openmpi-bin libopenmpi-dev
              libopenblas-dev python3 python3-venv python3-dev python3-pip
              libdnnl-dev  # oneDNN: the CPU backend's sgemm for small products
              libboost-context-dev   # fibers of the GPU emulation (emulation/README.md)
              iproute2 util-linux nftables)  # the virtual cluster of tests/cluster (vcluster.py)
# MGPU_SETUP_TORCH_PEER=1 (scripts/test.sh): Debian's PyTorch, the peer of `bench --compare torch`
if [ "${MGPU_SETUP_TORCH_PEER:-0}" = 1 ]; then
  APT_PACKAGES+=(python3-torch)
fi
missing=()
for p in "${APT_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing ${missing[*]}" >&2
  SUDO=""
  [ "$(id -u)" -ne 0 ] && SUDO=sudo
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

# One interpreter throughout: Debian's python3 (not a pyenv shim first on PATH).
PYTHON=/usr/bin/python3
if [ ! -x .venv/bin/python ]; then
  echo "setup: creating .venv" >&2
  "$PYTHON" -m venv .venv
fi
VPY=.venv/bin/python
export PIP_DISABLE_PIP_VERSION_CHECK=1
"$VPY" -m pip install -q --upgrade pip
"$VPY" -m pip install -q -r scripts/requirements.txt
# mpi4py from source so it links the same libmpi as mgpu._core (a binary wheel may not).
"$VPY" -m pip install -q --no-binary mpi4py "mpi4py>=3.1"
# Build and install mgpu (CMake build directory under build/ is reused).
"$VPY" -m pip install -q --no-build-isolation --no-deps .
"$VPY" -c "import mgpu; print('setup: mgpu', mgpu.__version__, 'ready in .venv', flush=True)" >&2
