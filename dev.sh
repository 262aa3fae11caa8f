#!/usr/bin/env bash
# One entry point for a fresh machine:
#   ./dev.sh demo   set everything up, then run the MoE training demo
#   ./dev.sh test   set everything up, then run the whole test suite (what CI runs)
#   ./dev.sh bench  set everything up, then run the CPU benchmarks (results in benchmarks/results/)
#   ./dev.sh setup  only set up: .venv, pinned dependencies, editable build
set -euo pipefail
cd "$(dirname "$0")"

setup() {
  if [ ! -x .venv/bin/python ]; then
    "${PYTHON:-python3}" -m venv .venv
  fi
  # shellcheck disable=SC1091
  . .venv/bin/activate
  # torch first and pinned: an unpinned torch pulls a multi-GB CUDA build.
  pip install -q torch==2.13.0
  pip install -q "jax==0.10.2" "jaxlib==0.10.2" "nanobind>=2.4" "scikit-build-core>=0.10" \
    "onednn-cpu-gomp==2023.2.0" "onednn-devel-cpu-gomp==2023.2.0" "scipy-openblas32>=0.3.27" \
    numpy ml_dtypes pytest hypothesis matplotlib
  if [ -x /usr/local/cuda/bin/nvcc ]; then
    export PATH="/usr/local/cuda/bin:$PATH"
  fi
  if command -v nvcc >/dev/null; then
    # CUTLASS headers only: the wheel's Python dependencies are not needed to build.
    pip install -q --no-deps "nvidia-cutlass==4.2.0.0"
  fi
  local started=$SECONDS
  pip install -q -e . --no-build-isolation
  python -c "import groupgemm; print('groupgemm built in $((SECONDS - started)) s; CUDA backend compiled:', groupgemm.cuda_compiled())"
}

core_tests() {
  # The core under AddressSanitizer + UndefinedBehaviorSanitizer, outside Python.
  cmake -S . -B build/sanitized -DGROUPGEMM_PYTHON=OFF -DGROUPGEMM_CUDA=OFF \
    -DGROUPGEMM_SANITIZED_TESTS=ON -DCMAKE_BUILD_TYPE=Debug -DPython_EXECUTABLE="$(command -v python)" >/dev/null
  cmake --build build/sanitized -j "$(nproc)" >/dev/null
  (cd build/sanitized && ctest --output-on-failure)
}

case "${1:-}" in
  setup) setup ;;
  test)
    setup
    core_tests
    python -m pytest tests -q
    ;;
  demo)
    setup
    python examples/moe_demo.py
    ;;
  bench)
    setup
    python benchmarks/core_throughput.py
    python benchmarks/bench.py --dtype float32 bfloat16
    ;;
  *)
    echo "usage: ./dev.sh {demo|test|bench|setup}" >&2
    exit 2
    ;;
esac
