#!/usr/bin/env bash
# Sets up everything mgpu needs on Debian 12 (run as root, or with sudo available):
# system packages from apt (compilers, CMake, OpenMPI, OpenBLAS, Python), a
# virtual environment at .venv on Debian's python3, the Python packages pyproject.toml
# lists from PyPI (mpi4py built against the system OpenMPI), and mgpu itself built into .venv.
# Idempotent: a second run only rebuilds what changed.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

APT_PACKAGES=(build-essential cmake ninja-build pkg-config openmpi-bin libopenmpi-dev
              libopenblas-dev python3 python3-venv python3-dev python3-pip
              libdnnl-dev  # oneDNN: the CPU backend's sgemm for small products
              libboost-context-dev   # fibers of the GPU emulation (emulation/README.md)
              iproute2 util-linux nftables  # the virtual cluster of tests/cluster (vcluster.py)
              clang-format git)  # the C++ style check of scripts/lint.sh (version 14 on Debian 12)
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
# The Python packages pyproject.toml lists, one a line: "build" ([build-system].requires),
# "runtime" ([project].dependencies), an extra's name, or "extras" (every extra but mpi).
requirements() {
  "$PYTHON" - "$@" <<'EOF_PY'
import sys
import tomllib

with open("pyproject.toml", "rb") as f:
    project = tomllib.load(f)
extras = project["project"]["optional-dependencies"]
listed = []
for part in sys.argv[1:]:
    if part == "build":
        listed += project["build-system"]["requires"]
    elif part == "runtime":
        listed += project["project"].get("dependencies", [])
    elif part == "extras":
        listed += [r for name, reqs in extras.items() if name != "mpi" for r in reqs]
    else:
        listed += extras[part]
print("\n".join(dict.fromkeys(listed)))  # each once, in order
EOF_PY
}
# The build requirements first, so `pip install --no-build-isolation .` needs no network.
build_reqs=$(requirements build)
mapfile -t build_reqs <<< "$build_reqs"
"$VPY" -m pip install -q "${build_reqs[@]}"
# mgpu's dependencies and every extra but mpi: what the tests, the notebooks and scripts/lint.sh (ruff) need.
reqs=$(requirements runtime extras)
mapfile -t reqs <<< "$reqs"
"$VPY" -m pip install -q "${reqs[@]}"
# The mpi extra, mpi4py, from source so it links the same libmpi as mgpu._core (a binary wheel may not).
mpi_reqs=$(requirements mpi)
mapfile -t mpi_reqs <<< "$mpi_reqs"
"$VPY" -m pip install -q --no-binary mpi4py "${mpi_reqs[@]}"
# Build and install mgpu (CMake build directory under build/ is reused).
"$VPY" -m pip install -q --no-build-isolation --no-deps .
"$VPY" -c "import mgpu; print('setup: mgpu', mgpu.__version__, 'ready in .venv', flush=True)" >&2
